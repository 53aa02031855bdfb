package eventplane

import (
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// ServerConfig configures the embedded NATS server a kvrouter node runs.
type ServerConfig struct {
	Name        string   // server name, unique in the NATS cluster (the node id)
	Addr        string   // client listen address host:port; port 0 (or -1) picks one
	ClusterName string   // default "kvrouter"
	ClusterAddr string   // route listen address host:port; empty: no NATS cluster
	Routes      []string // other servers' route addresses, host:port or nats-route://host:port
	// User and Password, when set, are required of clients.
	User, Password string
	// TLSCert and TLSKey (PEM files), when set, make clients connect with
	// TLS; TLSCA, when set too, requires of them a certificate that CA
	// signed. Routes between the servers stay plain (the cluster network).
	// In-process connections (the node's own) skip TLS.
	TLSCert, TLSKey, TLSCA string
	Logger                 *slog.Logger
}

func splitHostPort(addr string) (string, int, error) {
	host, p, err := net.SplitHostPort(addr)
	if err != nil {
		return "", 0, err
	}
	port, err := strconv.Atoi(p)
	if err != nil {
		return "", 0, fmt.Errorf("port %q: %w", p, err)
	}
	if port == 0 {
		port = server.RANDOM_PORT
	}
	return host, port, nil
}

// StartServer starts an embedded NATS server and waits until it accepts
// connections. Call Shutdown on it to stop it.
func StartServer(cfg ServerConfig) (*server.Server, error) {
	host, port, err := splitHostPort(cfg.Addr)
	if err != nil {
		return nil, fmt.Errorf("nats address %q: %w", cfg.Addr, err)
	}
	opts := &server.Options{
		ServerName: cfg.Name, Host: host, Port: port,
		Username: cfg.User, Password: cfg.Password,
		NoSigs: true, NoLog: true, MaxPayload: 8 << 20,
		// Publishers reconnect to any server of the cluster; the default
		// 2 s write deadline is fine, keep the rest at defaults.
	}
	if cfg.TLSCert != "" || cfg.TLSKey != "" {
		tc, err := server.GenTLSConfig(&server.TLSConfigOpts{CertFile: cfg.TLSCert, KeyFile: cfg.TLSKey,
			CaFile: cfg.TLSCA, Verify: cfg.TLSCA != ""})
		if err != nil {
			return nil, fmt.Errorf("nats TLS: %w", err)
		}
		opts.TLS, opts.TLSConfig, opts.TLSVerify, opts.TLSTimeout = true, tc, cfg.TLSCA != "", 2
	}
	if cfg.ClusterAddr != "" {
		ch, cp, err := splitHostPort(cfg.ClusterAddr)
		if err != nil {
			return nil, fmt.Errorf("nats cluster address %q: %w", cfg.ClusterAddr, err)
		}
		opts.Cluster = server.ClusterOpts{Name: cfg.ClusterName, Host: ch, Port: cp}
		if opts.Cluster.Name == "" {
			opts.Cluster.Name = "kvrouter"
		}
		var routes []string
		for _, r := range cfg.Routes {
			if r = strings.TrimSpace(r); r == "" {
				continue
			}
			if !strings.Contains(r, "://") {
				r = "nats-route://" + r
			}
			routes = append(routes, r)
		}
		opts.Routes = server.RoutesFromStr(strings.Join(routes, ","))
	}
	s, err := server.NewServer(opts)
	if err != nil {
		return nil, fmt.Errorf("nats server: %w", err)
	}
	logger := cfg.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	// The server reports a port it cannot listen on through Fatalf, from
	// its accept loop, and never gets ready: that message is the error,
	// at once (it took the whole wait before, and said only "did not
	// start").
	fatal := make(chan string, 1)
	s.SetLoggerV2(natsLogger{l: logger.With("component", "nats"), fatal: fatal}, false, false, false)
	go s.Start()
	for deadline := time.Now().Add(10 * time.Second); ; {
		if s.ReadyForConnections(20 * time.Millisecond) {
			return s, nil
		}
		select {
		case msg := <-fatal:
			s.Shutdown()
			return nil, fmt.Errorf("nats server on %s: %s", cfg.Addr, msg)
		default:
		}
		if time.Now().After(deadline) {
			s.Shutdown()
			return nil, fmt.Errorf("nats server on %s did not start within 10s", cfg.Addr)
		}
	}
}

// natsLogger sends the server's log lines to slog, and its first fatal
// one to fatal too.
type natsLogger struct {
	l     *slog.Logger
	fatal chan<- string
}

func (n natsLogger) Noticef(format string, v ...any) { n.l.Info(fmt.Sprintf(format, v...)) }
func (n natsLogger) Warnf(format string, v ...any)   { n.l.Warn(fmt.Sprintf(format, v...)) }
func (n natsLogger) Fatalf(format string, v ...any) {
	msg := fmt.Sprintf(format, v...)
	n.l.Error(msg)
	select {
	case n.fatal <- msg:
	default:
	}
}
func (n natsLogger) Errorf(format string, v ...any) { n.l.Error(fmt.Sprintf(format, v...)) }
func (n natsLogger) Debugf(format string, v ...any) { n.l.Debug(fmt.Sprintf(format, v...)) }
func (n natsLogger) Tracef(format string, v ...any) {}
