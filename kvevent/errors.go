package kvevent

import "errors"

var (
	// ErrUnknownMedium means an engine named a storage medium that maps to no
	// tier; the event carrying it is skipped and counted.
	ErrUnknownMedium = errors.New("unknown medium")
	// ErrUnknownTier means a tier label is not device, host, disk or external.
	ErrUnknownTier = errors.New("unknown tier")
	// ErrMalformed means an event breaks a structural rule (a hash repeated
	// within the event, a chain with its parent among its blocks, an
	// invalid tier or kind); it is skipped whole and never reaches the index.
	ErrMalformed = errors.New("malformed event")
)
