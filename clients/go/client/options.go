package client

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/keepalive"
)

// Option configures Dial.
type Option func(*options) error

type options struct {
	transport      grpc.DialOption
	defaultTimeout time.Duration
	maxRecvBytes   int
	keepalive      *keepalive.ClientParameters
	dialOptions    []grpc.DialOption
	lbPolicy       string
}

// WithInsecure selects a plaintext connection (local development, or a mesh sidecar that terminates TLS).
func WithInsecure() Option {
	return func(o *options) error {
		o.transport = grpc.WithInsecure()
		return nil
	}
}

// WithTLSConfig selects TLS with a caller-built configuration (custom verification, client certificates, ...).
func WithTLSConfig(cfg *tls.Config) Option {
	return func(o *options) error {
		if cfg == nil {
			return errors.New("pagedserve: WithTLSConfig needs a non-nil *tls.Config")
		}
		o.transport = grpc.WithTransportCredentials(credentials.NewTLS(cfg))
		return nil
	}
}

// WithTLS selects TLS that verifies the server against caFile (PEM); an empty caFile uses the system roots.
// serverName overrides the name checked against the certificate; empty means the host part of the target.
func WithTLS(caFile, serverName string) Option {
	return WithMTLS(caFile, "", "", serverName)
}

// WithMTLS is WithTLS plus a client certificate and key (PEM files) for servers that require mutual TLS.
func WithMTLS(caFile, certFile, keyFile, serverName string) Option {
	return func(o *options) error {
		cfg, err := tlsConfig(caFile, certFile, keyFile, serverName)
		if err != nil {
			return err
		}
		o.transport = grpc.WithTransportCredentials(credentials.NewTLS(cfg))
		return nil
	}
}

// WithDefaultTimeout gives every call a deadline of d unless its context already carries one.
func WithDefaultTimeout(d time.Duration) Option {
	return func(o *options) error {
		if d <= 0 {
			return fmt.Errorf("pagedserve: default timeout must be positive, got %v", d)
		}
		o.defaultTimeout = d
		return nil
	}
}

// WithMaxRecvMsgSize raises the 4 MiB gRPC default, for example for responses carrying many logprobs.
func WithMaxRecvMsgSize(bytes int) Option {
	return func(o *options) error {
		if bytes <= 0 {
			return fmt.Errorf("pagedserve: max receive size must be positive, got %d", bytes)
		}
		o.maxRecvBytes = bytes
		return nil
	}
}

// WithKeepalive pings an idle connection every interval so that proxies with idle timeouts keep long
// streams open; timeout is how long to wait for the ping's answer before closing the connection.
func WithKeepalive(interval, timeout time.Duration) Option {
	return func(o *options) error {
		if interval <= 0 || timeout <= 0 {
			return fmt.Errorf("pagedserve: keepalive interval and timeout must be positive, got %v, %v",
				interval, timeout)
		}
		o.keepalive = &keepalive.ClientParameters{Time: interval, Timeout: timeout, PermitWithoutStream: true}
		return nil
	}
}

// WithDialOptions passes extra grpc.DialOptions through (interceptors, balancers, ...).
func WithDialOptions(opts ...grpc.DialOption) Option {
	return func(o *options) error {
		o.dialOptions = append(o.dialOptions, opts...)
		return nil
	}
}

func (o *options) grpcDialOptions() ([]grpc.DialOption, error) {
	if o.transport == nil {
		// Like grpc-go itself: never fall back to plaintext silently.
		return nil, errors.New("pagedserve: choose a transport: WithInsecure, WithTLS, WithMTLS or WithTLSConfig")
	}
	dial := []grpc.DialOption{o.transport, serviceConfig(o.lbPolicy)}
	if o.maxRecvBytes > 0 {
		dial = append(dial, grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(o.maxRecvBytes)))
	}
	if o.keepalive != nil {
		dial = append(dial, grpc.WithKeepaliveParams(*o.keepalive))
	}
	return append(dial, o.dialOptions...), nil
}

func tlsConfig(caFile, certFile, keyFile, serverName string) (*tls.Config, error) {
	cfg := &tls.Config{ServerName: serverName, MinVersion: tls.VersionTLS12}
	if caFile != "" {
		pem, err := os.ReadFile(caFile)
		if err != nil {
			return nil, fmt.Errorf("pagedserve: reading CA file: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("pagedserve: no PEM certificate found in %s", caFile)
		}
		cfg.RootCAs = pool
	}
	if (certFile == "") != (keyFile == "") {
		return nil, errors.New("pagedserve: mutual TLS needs both a certificate and a key file")
	}
	if certFile != "" {
		pair, err := tls.LoadX509KeyPair(certFile, keyFile)
		if err != nil {
			return nil, fmt.Errorf("pagedserve: loading client certificate: %w", err)
		}
		cfg.Certificates = []tls.Certificate{pair}
	}
	return cfg, nil
}
