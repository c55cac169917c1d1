package dev.pagedserve.client;

import io.grpc.ManagedChannel;
import io.grpc.netty.GrpcSslContexts;
import io.grpc.netty.NettyChannelBuilder;
import io.netty.handler.ssl.SslContext;
import io.netty.handler.ssl.SslContextBuilder;
import java.io.UncheckedIOException;
import java.util.concurrent.TimeUnit;
import javax.net.ssl.SSLException;

/** ClientOptions -> a Netty channel (plaintext, TLS or mutual TLS). */
final class Channels {
  private Channels() {}

  @SuppressWarnings("deprecation") // nameResolverFactory: the per-channel way to serve an address list in 1.41
  static ManagedChannel open(String target, ClientOptions options) {
    AddressList addresses = AddressList.parse(target);
    NettyChannelBuilder builder = NettyChannelBuilder.forTarget(
        addresses == null ? target : addresses.channelTarget());
    if (addresses != null) {
      builder.nameResolverFactory(addresses);
    }
    // Standard service config: spread calls over every resolved address (dns:/// names, address lists).
    builder.defaultLoadBalancingPolicy(options.loadBalancingPolicy());
    if (options.plaintext()) {
      builder.usePlaintext();
    } else {
      builder.sslContext(sslContext(options));
    }
    options.authorityOverride().ifPresent(builder::overrideAuthority);
    options.keepaliveInterval().ifPresent(interval -> builder
        .keepAliveTime(interval.toNanos(), TimeUnit.NANOSECONDS)
        .keepAliveTimeout(options.keepaliveTimeout().toNanos(), TimeUnit.NANOSECONDS)
        .keepAliveWithoutCalls(true));
    builder.maxInboundMessageSize(options.maxInboundMessageBytes());
    return builder.build();
  }

  private static SslContext sslContext(ClientOptions options) {
    try {
      try {
        return GrpcSslContexts.configure(tlsMaterial(options)).build();
      } catch (UnsupportedOperationException e) {
        // Debian's netty cannot do ALPN with the JDK provider on its own; see JdkAlpn.
        return JdkAlpn.h2Client(tlsMaterial(options));
      }
    } catch (SSLException e) {
      throw new UncheckedIOException("setting up TLS", e);
    }
  }

  private static SslContextBuilder tlsMaterial(ClientOptions options) {
    SslContextBuilder builder = SslContextBuilder.forClient();
    options.caPem().ifPresent(builder::trustManager);
    options.clientKeyPair().ifPresent(pair -> builder.keyManager(pair[0], pair[1]));
    return builder;
  }
}
