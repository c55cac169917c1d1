package dev.pagedserve.client;

import java.io.File;
import java.time.Duration;
import java.util.Objects;
import java.util.Optional;

/**
 * How {@link PagedServeClient#connect} reaches the server. Immutable; build with {@link #builder()}.
 *
 * <pre>{@code
 * ClientOptions.builder().mtls(caPem, clientCertPem, clientKeyPem).defaultTimeout(Duration.ofSeconds(30)).build()
 * }</pre>
 */
public final class ClientOptions {
  private final boolean plaintext;
  private final File caPem;
  private final File clientCertPem;
  private final File clientKeyPem;
  private final String authorityOverride;
  private final Duration defaultTimeout;
  private final Duration keepaliveInterval;
  private final Duration keepaliveTimeout;
  private final int maxInboundMessageBytes;
  private final String loadBalancingPolicy;

  private ClientOptions(Builder b) {
    if (!b.transportChosen) {
      // Never fall back to plaintext silently.
      throw new IllegalArgumentException("choose a transport: plaintext(), tls(...) or mtls(...)");
    }
    this.plaintext = b.plaintext;
    this.caPem = b.caPem;
    this.clientCertPem = b.clientCertPem;
    this.clientKeyPem = b.clientKeyPem;
    this.authorityOverride = b.authorityOverride;
    this.defaultTimeout = b.defaultTimeout;
    this.keepaliveInterval = b.keepaliveInterval;
    this.keepaliveTimeout = b.keepaliveTimeout;
    this.maxInboundMessageBytes = b.maxInboundMessageBytes;
    this.loadBalancingPolicy = b.loadBalancingPolicy;
  }

  public static Builder builder() {
    return new Builder();
  }

  boolean plaintext() {
    return plaintext;
  }

  /** PEM CA bundle; empty: the JDK's trusted roots. */
  Optional<File> caPem() {
    return Optional.ofNullable(caPem);
  }

  /** Client certificate and key for mutual TLS; empty: no client certificate. */
  Optional<File[]> clientKeyPair() {
    return clientCertPem == null ? Optional.empty() : Optional.of(new File[] {clientCertPem, clientKeyPem});
  }

  Optional<String> authorityOverride() {
    return Optional.ofNullable(authorityOverride);
  }

  Optional<Duration> defaultTimeout() {
    return Optional.ofNullable(defaultTimeout);
  }

  Optional<Duration> keepaliveInterval() {
    return Optional.ofNullable(keepaliveInterval);
  }

  Duration keepaliveTimeout() {
    return keepaliveTimeout;
  }

  int maxInboundMessageBytes() {
    return maxInboundMessageBytes;
  }

  String loadBalancingPolicy() {
    return loadBalancingPolicy;
  }

  /** Mutable builder; every setter validates its argument. */
  public static final class Builder {
    private boolean transportChosen;
    private boolean plaintext;
    private File caPem;
    private File clientCertPem;
    private File clientKeyPem;
    private String authorityOverride;
    private Duration defaultTimeout;
    private Duration keepaliveInterval;
    private Duration keepaliveTimeout = Duration.ofSeconds(20);
    private int maxInboundMessageBytes = 4 << 20;
    private String loadBalancingPolicy = "round_robin";

    private Builder() {}

    /** No TLS: local development, or a mesh sidecar that terminates TLS. */
    public Builder plaintext() {
      transportChosen = true;
      plaintext = true;
      caPem = clientCertPem = clientKeyPem = null;
      return this;
    }

    /** TLS verifying the server against a PEM CA bundle; {@code null} uses the JDK's trusted roots. */
    public Builder tls(File caPem) {
      return mtls(caPem, null, null);
    }

    /** TLS plus a client certificate chain and PKCS#8 private key (PEM files) for mutual TLS. */
    public Builder mtls(File caPem, File clientCertPem, File clientKeyPem) {
      if ((clientCertPem == null) != (clientKeyPem == null)) {
        throw new IllegalArgumentException("mutual TLS needs both a certificate and a key file");
      }
      for (File f : new File[] {caPem, clientCertPem, clientKeyPem}) {
        if (f != null && !f.isFile()) {
          throw new IllegalArgumentException("TLS file not found: " + f);
        }
      }
      transportChosen = true;
      plaintext = false;
      this.caPem = caPem;
      this.clientCertPem = clientCertPem;
      this.clientKeyPem = clientKeyPem;
      return this;
    }

    /** The name checked against the server certificate (and sent as :authority), when not the target host. */
    public Builder authorityOverride(String authority) {
      this.authorityOverride = Objects.requireNonNull(authority, "authority");
      return this;
    }

    /** Deadline applied to every call that does not get one from {@link PagedServeClient#withTimeout}. */
    public Builder defaultTimeout(Duration timeout) {
      this.defaultTimeout = positive(timeout, "defaultTimeout");
      return this;
    }

    /** Ping an idle connection so that proxies with idle timeouts keep long streams open. */
    public Builder keepalive(Duration interval, Duration timeout) {
      this.keepaliveInterval = positive(interval, "keepalive interval");
      this.keepaliveTimeout = positive(timeout, "keepalive timeout");
      return this;
    }

    /** Raise the 4 MiB default, for example for responses carrying many logprobs. */
    public Builder maxInboundMessageBytes(int bytes) {
      if (bytes <= 0) {
        throw new IllegalArgumentException("maxInboundMessageBytes must be positive, got " + bytes);
      }
      this.maxInboundMessageBytes = bytes;
      return this;
    }

    /**
     * "round_robin" (the default: calls spread over every address a dns:/// name or an ipv4:/ipv6: address list
     * resolves to) or "pick_first".
     */
    public Builder loadBalancingPolicy(String policy) {
      if (!"round_robin".equals(policy) && !"pick_first".equals(policy)) {
        throw new IllegalArgumentException("loadBalancingPolicy must be round_robin or pick_first, got " + policy);
      }
      this.loadBalancingPolicy = policy;
      return this;
    }

    public ClientOptions build() {
      return new ClientOptions(this);
    }

    private static Duration positive(Duration d, String what) {
      if (d == null || d.isNegative() || d.isZero()) {
        throw new IllegalArgumentException(what + " must be positive, got " + d);
      }
      return d;
    }
  }
}
