package com.moeblaze;

/**
 * A failed moeblaze call: the {@code moeblaze_status_t} and the library's message for it.
 * Unchecked, like the JDK's own argument errors.
 */
public class MoeblazeException extends RuntimeException {
  private static final long serialVersionUID = 1L;

  public static final int INVALID_ARGUMENT = 1;
  public static final int INVALID_HANDLE = 2;
  public static final int NOT_SUPPORTED = 3;
  public static final int INSUFFICIENT_WORKSPACE = 4;
  public static final int OUT_OF_MEMORY = 5;
  public static final int CUDA = 6;
  public static final int VERSION_MISMATCH = 7;
  public static final int NON_FINITE = 8;
  public static final int INTERNAL = 99;

  private final int status;

  /** Called from the JNI layer with the status and the thread's last error message. */
  public MoeblazeException(int status, String message) {
    super(message);
    this.status = status;
  }

  /** The moeblaze_status_t code (MOEBLAZE_ERR_*). */
  public int getStatus() {
    return status;
  }

  /** The enumerator name, e.g. "MOEBLAZE_ERR_INVALID_ARGUMENT". */
  public String getStatusName() {
    return com.moeblaze.internal.moeblaze.moeblaze_status_name(status);
  }
}
