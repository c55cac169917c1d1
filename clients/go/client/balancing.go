package client

import (
	"fmt"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/resolver"
	"google.golang.org/grpc/resolver/manual"
)

// RoundRobin is the standard gRPC service config that spreads calls over every address the target resolves to
// (all A/AAAA records of a dns:/// name, every entry of an address list); Dial uses it unless
// WithLoadBalancingPolicy says otherwise.
const RoundRobin = "round_robin"

// addressListScheme names the per-connection resolver that serves an "ipv4:" / "ipv6:" address list.
const addressListScheme = "pagedserve-addresses"

// WithLoadBalancingPolicy picks the gRPC load-balancing policy: "round_robin" (the default) or "pick_first".
func WithLoadBalancingPolicy(policy string) Option {
	return func(o *options) error {
		if policy != RoundRobin && policy != "pick_first" {
			return fmt.Errorf("pagedserve: load-balancing policy must be round_robin or pick_first, got %q", policy)
		}
		o.lbPolicy = policy
		return nil
	}
}

func serviceConfig(policy string) grpc.DialOption {
	if policy == "" {
		policy = RoundRobin
	}
	return grpc.WithDefaultServiceConfig(fmt.Sprintf(`{"loadBalancingConfig":[{%q:{}}]}`, policy))
}

// resolveTarget turns the address-list targets that gRPC C core (and so the Python client) understands,
// "ipv4:10.0.0.1:50051,10.0.0.2:50051" and "ipv6:[::1]:50051,...", into a static resolver for this connection;
// grpc-go has no such scheme. Every other target (host:port, dns:///name:port, unix:...) passes through.
func resolveTarget(target string) (string, []grpc.DialOption, error) {
	var list string
	for _, scheme := range []string{"ipv4:", "ipv6:"} {
		if strings.HasPrefix(target, scheme) {
			list = strings.TrimPrefix(target, scheme)
		}
	}
	if list == "" {
		return target, nil, nil
	}
	var addrs []resolver.Address
	for _, addr := range strings.Split(list, ",") {
		if addr = strings.TrimSpace(addr); addr == "" {
			return "", nil, fmt.Errorf("pagedserve: empty address in target %q", target)
		}
		addrs = append(addrs, resolver.Address{Addr: addr})
	}
	r := manual.NewBuilderWithScheme(addressListScheme)
	r.InitialState(resolver.State{Addresses: addrs})
	return addressListScheme + ":///" + list, []grpc.DialOption{grpc.WithResolvers(r)}, nil
}
