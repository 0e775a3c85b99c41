package com.moeblaze;

import com.moeblaze.internal.moeblaze;

/**
 * One backend on one device. Close it (try-with-resources) to destroy the handle; layers created
 * on it stay valid (the library keeps what they need). Thread-safe: the C API synchronises
 * contexts internally.
 */
public final class Context implements AutoCloseable {
  private long handle;
  private final Enums.Backend backend;
  private final int device;

  public Context(Enums.Backend backend, int device) {
    Library.checkAbi();
    long[] out = new long[1];
    moeblaze.moeblaze_context_create(out, backend.code, device);
    this.handle = out[0];
    int[] backendCode = new int[1];
    int[] deviceId = new int[1];
    moeblaze.moeblaze_context_get_info(handle, backendCode, deviceId);
    this.backend = Enums.Backend.of(backendCode[0]);
    this.device = deviceId[0];
  }

  /** The CPU reference backend. */
  public static Context cpu() {
    return new Context(Enums.Backend.CPU, 0);
  }

  public Enums.Backend getBackend() {
    return backend;
  }

  public int getDevice() {
    return device;
  }

  public void setNumThreads(int numThreads) {
    moeblaze.moeblaze_context_set_num_threads(handle(), numThreads);
  }

  /** The C handle (moeblaze_context_t) as a long. */
  public synchronized long handle() {
    if (handle == 0) throw new IllegalStateException("Context is closed");
    return handle;
  }

  @Override
  public synchronized void close() {
    if (handle != 0) {
      long h = handle;
      handle = 0;
      moeblaze.moeblaze_context_destroy(h);
    }
  }

  @Override
  public String toString() {
    return "Context(" + backend + ":" + device + (handle == 0 ? ", closed" : "") + ")";
  }
}
