package eventplane

import (
	"time"

	"github.com/nats-io/nats.go"
)

// ClientOptions are how agents and routers connect to NATS: an embedded
// server of the router cluster, or an external NATS. The zero value
// connects without credentials or TLS.
type ClientOptions struct {
	Name           string // the connection's name, as the server shows it
	User, Password string
	Creds          string // a credentials file (JWT and seed), for an external NATS
	// TLSCA is a PEM file of the CA that signed the server's certificate
	// (default: the system's roots once TLS is on); TLSCert and TLSKey are
	// this client's certificate, for servers that require one.
	TLSCA, TLSCert, TLSKey string
}

// NATSOptions returns the nats.Connect options of o: reconnect for ever
// (an agent must survive the loss of any router node), then credentials and
// TLS as set.
func (o ClientOptions) NATSOptions() []nats.Option {
	opts := []nats.Option{nats.MaxReconnects(-1), nats.ReconnectWait(250 * time.Millisecond)}
	if o.Name != "" {
		opts = append(opts, nats.Name(o.Name))
	}
	if o.User != "" {
		opts = append(opts, nats.UserInfo(o.User, o.Password))
	}
	if o.Creds != "" {
		opts = append(opts, nats.UserCredentials(o.Creds))
	}
	if o.TLSCA != "" {
		opts = append(opts, nats.RootCAs(o.TLSCA))
	}
	if o.TLSCert != "" || o.TLSKey != "" {
		opts = append(opts, nats.ClientCert(o.TLSCert, o.TLSKey))
	}
	return opts
}
