package dev.pagedserve.client;

import io.netty.handler.ssl.ClientAuth;
import io.netty.handler.ssl.IdentityCipherSuiteFilter;
import io.netty.handler.ssl.JdkApplicationProtocolNegotiator;
import io.netty.handler.ssl.JdkSslContext;
import io.netty.handler.ssl.SslContext;
import io.netty.handler.ssl.SslContextBuilder;
import io.netty.handler.ssl.SslProvider;
import java.lang.reflect.Constructor;
import java.util.List;
import javax.net.ssl.SSLContext;
import javax.net.ssl.SSLEngine;
import javax.net.ssl.SSLException;
import javax.net.ssl.SSLHandshakeException;

/**
 * TLS with ALPN "h2" over the JDK's own TLS, for netty builds that dropped their JDK ALPN negotiator (Debian's
 * netty 4.1.48 removes it together with its Conscrypt and Jetty-ALPN paths, so GrpcSslContexts fails with
 * "JDK provider does not support ALPN"). Upstream netty never gets here: {@link Channels} uses this only after the
 * normal path threw.
 *
 * <p>Everything public is implemented here; the two package-private netty pieces it needs (the Java 9+ engine
 * wrapper that reports the negotiated protocol, and the JdkSslContext constructor that takes a negotiator) are
 * reached by reflection, which works on the class path and on the module path (netty's jars are automatic
 * modules, which open every package).
 */
final class JdkAlpn {
  private static final List<String> H2 = List.of("h2");

  private JdkAlpn() {}

  /** {@code builder.build()} with the JDK provider, plus ALPN offering and requiring "h2" (what gRPC needs). */
  static SslContext h2Client(SslContextBuilder builder) throws SSLException {
    JdkSslContext plain = (JdkSslContext) builder.sslProvider(SslProvider.JDK).build();
    try {
      Constructor<JdkSslContext> ctor = JdkSslContext.class.getDeclaredConstructor(SSLContext.class, boolean.class,
          Iterable.class, io.netty.handler.ssl.CipherSuiteFilter.class, JdkApplicationProtocolNegotiator.class,
          ClientAuth.class, String[].class, boolean.class);
      ctor.setAccessible(true);
      return ctor.newInstance(plain.context(), true, plain.cipherSuites(), IdentityCipherSuiteFilter.INSTANCE,
          new H2Negotiator(java9EngineConstructor()), ClientAuth.NONE, null, false);
    } catch (ReflectiveOperationException | RuntimeException e) {
      throw new SSLException("this netty build has no JDK ALPN support and its internals differ from 4.1.48; "
          + "use upstream netty or grpc-netty-shaded", e);
    }
  }

  private static Constructor<?> java9EngineConstructor() throws ReflectiveOperationException {
    Constructor<?> ctor = Class.forName("io.netty.handler.ssl.Java9SslEngine").getDeclaredConstructor(
        SSLEngine.class, JdkApplicationProtocolNegotiator.class, boolean.class);
    ctor.setAccessible(true);
    return ctor;
  }

  /** Offers "h2" and fails the handshake when the server picks anything else (or nothing). */
  @SuppressWarnings("deprecation")
  private static final class H2Negotiator implements JdkApplicationProtocolNegotiator {
    private final Constructor<?> java9Engine;

    H2Negotiator(Constructor<?> java9Engine) {
      this.java9Engine = java9Engine;
    }

    @Override
    public List<String> protocols() {
      return H2;
    }

    @Override
    public SslEngineWrapperFactory wrapperFactory() {
      return (engine, negotiator, isServer) -> {
        try {
          return (SSLEngine) java9Engine.newInstance(engine, negotiator, isServer);
        } catch (ReflectiveOperationException e) {
          throw new IllegalStateException("wrapping the SSLEngine for ALPN", e);
        }
      };
    }

    @Override
    public ProtocolSelectorFactory protocolSelectorFactory() {
      return (engine, supported) -> new ProtocolSelector() {
        @Override
        public void unsupported() {}

        @Override
        public String select(List<String> offered) throws Exception {
          if (!offered.contains("h2")) {
            throw new SSLHandshakeException("peer does not offer h2");
          }
          return "h2";
        }
      };
    }

    @Override
    public ProtocolSelectionListenerFactory protocolListenerFactory() {
      return (engine, supported) -> new ProtocolSelectionListener() {
        @Override
        public void unsupported() {}

        @Override
        public void selected(String protocol) throws Exception {
          if (!"h2".equals(protocol)) {
            throw new SSLHandshakeException("server selected " + protocol + " instead of h2");
          }
        }
      };
    }
  }
}
