package io.netty.handler.ssl;

import io.netty.buffer.ByteBufAllocator;
import javax.net.ssl.SSLEngine;
import javax.net.ssl.SSLException;

/**
 * ALPN with the JDK's own TLS for Debian's netty 4.1.48, which drops JdkAlpnApplicationProtocolNegotiator
 * (it also references Conscrypt and Jetty ALPN, which Debian does not ship). Without it netty refuses ALPN
 * ("JDK provider does not support ALPN protocol") and gRPC cannot use TLS at all. Upstream netty never needs
 * this: dev.pagedserve.client uses it only after the normal path failed.
 *
 * <p>It lives in netty's package because what it wires together (Java9SslEngine, the negotiator base class
 * and the JdkSslContext constructor that takes one) is package-private.
 */
public final class JdkAlpnShim {
  private JdkAlpnShim() {}

  /** A client context like {@code builder.build()}, plus ALPN offering only "h2" (what gRPC requires). */
  public static SslContext h2Client(SslContextBuilder builder) throws SSLException {
    JdkSslContext plain = (JdkSslContext) builder.sslProvider(SslProvider.JDK).build();
    JdkApplicationProtocolNegotiator h2 = new JdkBaseApplicationProtocolNegotiator(new Java9Wrapper(),
        JdkBaseApplicationProtocolNegotiator.NO_FAIL_SELECTOR_FACTORY,
        JdkBaseApplicationProtocolNegotiator.NO_FAIL_SELECTION_LISTENER_FACTORY, "h2");
    return new JdkSslContext(plain.context(), true, plain.cipherSuites(), IdentityCipherSuiteFilter.INSTANCE, h2,
        ClientAuth.NONE, null, false);
  }

  /** JDK 9+ SSLEngines do ALPN themselves; Java9SslEngine exposes the result the way netty reads it. */
  private static final class Java9Wrapper extends JdkApplicationProtocolNegotiator.AllocatorAwareSslEngineWrapperFactory {
    @Override
    SSLEngine wrapSslEngine(SSLEngine engine, ByteBufAllocator alloc, JdkApplicationProtocolNegotiator negotiator,
        boolean isServer) {
      return new Java9SslEngine(engine, negotiator, isServer);
    }
  }
}
