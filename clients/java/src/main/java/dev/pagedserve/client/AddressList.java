package dev.pagedserve.client;

import io.grpc.EquivalentAddressGroup;
import io.grpc.NameResolver;
import java.net.InetSocketAddress;
import java.net.SocketAddress;
import java.net.URI;
import java.util.ArrayList;
import java.util.List;

/**
 * The address-list targets gRPC C core (and so the Python client) understands, {@code
 * ipv4:10.0.0.1:50051,10.0.0.2:50051} and {@code ipv6:[::1]:50051,...}, for grpc-java, which has no such scheme:
 * a resolver that hands the channel every listed address, so the round_robin policy spreads calls over them.
 */
final class AddressList extends NameResolver.Factory {
  private static final String SCHEME = "pagedserve-addresses";
  private final List<EquivalentAddressGroup> groups;
  private final String authority;

  private AddressList(List<EquivalentAddressGroup> groups, String authority) {
    this.groups = groups;
    this.authority = authority;
  }

  /** The factory for an "ipv4:"/"ipv6:" target, else null (the target goes to grpc-java's own resolvers). */
  static AddressList parse(String target) {
    String list = null;
    for (String scheme : new String[] {"ipv4:", "ipv6:"}) {
      if (target.startsWith(scheme)) {
        list = target.substring(scheme.length());
      }
    }
    if (list == null) {
      return null;
    }
    List<EquivalentAddressGroup> groups = new ArrayList<>();
    String first = null;
    for (String entry : list.split(",", -1)) {
      URI hostPort = URI.create("//" + entry.trim());
      if (hostPort.getHost() == null || hostPort.getPort() < 0) {
        throw new IllegalArgumentException("not host:port in target " + target + ": '" + entry + "'");
      }
      first = first == null ? hostPort.getHost() : first;
      SocketAddress address = new InetSocketAddress(hostPort.getHost(), hostPort.getPort());
      groups.add(new EquivalentAddressGroup(address));
    }
    return new AddressList(List.copyOf(groups), first);
  }

  /** The target string to hand the channel builder together with this factory. */
  String channelTarget() {
    return SCHEME + ":///addresses";
  }

  @Override
  public NameResolver newNameResolver(URI targetUri, NameResolver.Args args) {
    if (!SCHEME.equals(targetUri.getScheme())) {
      return null;
    }
    return new NameResolver() {
      @Override
      public String getServiceAuthority() {
        return authority;
      }

      @Override
      public void start(Listener2 listener) {
        listener.onResult(ResolutionResult.newBuilder().setAddresses(groups).build());
      }

      @Override
      public void refresh() {}

      @Override
      public void shutdown() {}
    };
  }

  @Override
  public String getDefaultScheme() {
    return SCHEME;
  }
}
