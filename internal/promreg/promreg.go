// Package promreg registers Prometheus collectors that several instances
// of one component share: api Servers, eventplane ingesters made again on
// a node restarted in-process, enginesub subscribers of one group.
//
// Invariant: registering a family a second time on the same Registerer
// returns the collector registered first (the same series, counting on),
// never a second family and never a panic; a collector of another type
// or shape under that name is an error the caller decides about.
package promreg

import (
	"errors"
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
)

// Register registers c on reg and returns it, or the collector of the
// same family registered before (prometheus.AlreadyRegisteredError), if
// it is a C. Any other refusal (a family of that name with other labels
// or help, or an existing collector of another type) is returned with c.
func Register[C prometheus.Collector](reg prometheus.Registerer, c C) (C, error) {
	err := reg.Register(c)
	if err == nil {
		return c, nil
	}
	var are prometheus.AlreadyRegisteredError
	if errors.As(err, &are) {
		if existing, ok := are.ExistingCollector.(C); ok {
			return existing, nil
		}
		return c, fmt.Errorf("%w: the family registered before is a %T", err, are.ExistingCollector)
	}
	return c, err
}
