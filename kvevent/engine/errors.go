package engine

import "errors"

var (
	// ErrPayload means a payload is not a decodable batch: it is truncated,
	// not valid msgpack, not shaped as [ts, events, dp_rank?] or
	// {ts, events, data_parallel_rank}, or has bytes after the batch. Nothing
	// from it is emitted and the Batch is left as it was; the error wraps the
	// byte offset and the cause. A malformed *event* is not an ErrPayload: it
	// is skipped and counted in Stats, and the rest of the batch decodes.
	ErrPayload = errors.New("malformed payload")
	// ErrConfig means a Decoder was configured with an impossible value.
	ErrConfig = errors.New("invalid decoder config")
)
