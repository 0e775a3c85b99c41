package com.moeblaze;

import com.moeblaze.internal.moeblaze;
import com.moeblaze.internal.moeblazeConstants;

/** Library-wide queries and the ABI check done before the first handle is created. */
public final class Library {
  private Library() {}

  private static volatile boolean checked;

  public static int version() {
    return moeblaze.moeblaze_get_version();
  }

  public static int abiVersion() {
    return moeblaze.moeblaze_get_abi_version();
  }

  public static String buildInfo() {
    return moeblaze.moeblaze_get_build_info();
  }

  public static boolean backendAvailable(Enums.Backend backend) {
    return moeblaze.moeblaze_backend_available(backend.code) == 1;
  }

  /** The calling thread's last error message ("" after a successful call). */
  public static String lastError() {
    return moeblaze.moeblaze_last_error();
  }

  static void checkAbi() {
    if (checked) return;
    int abi = abiVersion();
    if (abi != moeblazeConstants.MOEBLAZE_ABI_VERSION) {
      throw new MoeblazeException(MoeblazeException.VERSION_MISMATCH,
          "libmoeblaze has ABI version " + abi + ", these bindings need "
              + moeblazeConstants.MOEBLAZE_ABI_VERSION);
    }
    checked = true;
  }
}
