package com.moeblaze;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;

/** Direct, native-order, 64-byte-aligned host buffers (what the CPU backend reads and writes). */
public final class Buffers {
  private Buffers() {}

  public static final int ALIGNMENT = 64;

  /** A zero-filled direct buffer of {@code bytes} bytes, aligned to {@link #ALIGNMENT}. */
  public static ByteBuffer allocate(long bytes) {
    return allocate("buffer", bytes);
  }

  /** As {@link #allocate(long)}; {@code name} names the buffer in the exception for a bad size. */
  static ByteBuffer allocate(String name, long bytes) {
    if (bytes < 0 || bytes > Integer.MAX_VALUE - 2 * ALIGNMENT) {
      throw new IllegalArgumentException(name + ": size " + bytes + " bytes is out of range (a "
          + "ByteBuffer holds at most " + (Integer.MAX_VALUE - 2 * ALIGNMENT) + " here)");
    }
    // alignedSlice rounds the start up and the end down: leave room for both.
    long rounded = (bytes + ALIGNMENT - 1) / ALIGNMENT * ALIGNMENT;
    ByteBuffer raw = ByteBuffer.allocateDirect((int) rounded + ALIGNMENT);
    ByteBuffer aligned = raw.alignedSlice(ALIGNMENT);
    aligned.limit((int) bytes);
    return aligned.slice().order(ByteOrder.nativeOrder());
  }

  public static ByteBuffer of(float... values) {
    ByteBuffer buffer = allocate(4L * values.length);
    buffer.asFloatBuffer().put(values);
    return buffer;
  }

  public static ByteBuffer of(double... values) {
    ByteBuffer buffer = allocate(8L * values.length);
    buffer.asDoubleBuffer().put(values);
    return buffer;
  }

  public static ByteBuffer ofInts(int... values) {
    ByteBuffer buffer = allocate(4L * values.length);
    buffer.asIntBuffer().put(values);
    return buffer;
  }

  public static float[] toFloats(ByteBuffer buffer) {
    float[] out = new float[buffer.capacity() / 4];
    buffer.duplicate().order(ByteOrder.nativeOrder()).asFloatBuffer().get(out);
    return out;
  }

  public static double[] toDoubles(ByteBuffer buffer) {
    double[] out = new double[buffer.capacity() / 8];
    buffer.duplicate().order(ByteOrder.nativeOrder()).asDoubleBuffer().get(out);
    return out;
  }

  public static int[] toInts(ByteBuffer buffer) {
    int[] out = new int[buffer.capacity() / 4];
    buffer.duplicate().order(ByteOrder.nativeOrder()).asIntBuffer().get(out);
    return out;
  }

  /** The native address of a direct buffer (its start, whatever its position); 0 for null. */
  public static long address(ByteBuffer buffer) {
    return address("buffer", buffer);
  }

  /**
   * As {@link #address(ByteBuffer)}; {@code name} names the argument in the exception thrown for a
   * heap buffer (ByteBuffer.allocate or wrap), which has no native address.
   */
  public static long address(String name, ByteBuffer buffer) {
    if (buffer == null) return 0;
    if (!buffer.isDirect()) {
      throw new IllegalArgumentException(name + " is a heap ByteBuffer (ByteBuffer.allocate or "
          + "wrap), which has no native address: pass a direct buffer (Buffers.allocate or "
          + "ByteBuffer.allocateDirect)");
    }
    return com.moeblaze.internal.moeblaze.moeblaze_java_buffer_address(buffer);
  }
}
