package com.moeblaze.internal;

import java.io.BufferedReader;
import java.io.IOException;
import java.io.InputStream;
import java.io.InputStreamReader;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.List;
import java.util.Locale;

/**
 * Loads libmoeblaze_jni (and, from the jar, the core libmoeblaze) exactly once, for moeblazeJNI.
 *
 * <p>Order: -Dmoeblaze.jni.library=&lt;path&gt; if set (nothing else is tried, so a wrong path is
 * reported rather than silently replaced); else System.loadLibrary("moeblaze_jni") through
 * java.library.path, so an installed or build-tree library wins over the bundled copy; else the
 * natives bundled under native/&lt;os&gt;-&lt;arch&gt;/ in the jar, extracted to a private temporary
 * directory. The core library is loaded first by absolute path: the dynamic linker then satisfies
 * the JNI library's DT_NEEDED libmoeblaze.so.N with the object already loaded under that SONAME, and
 * the bundled JNI library's RUNPATH $ORIGIN finds the extracted copy as well.
 */
public final class NativeLoader {
  public static final String JNI_LIBRARY = "moeblaze_jni";
  /** Lists the bundled libraries, one file name a line, in load order (the JNI library last). */
  static final String INDEX_FILE = "LIBRARIES";

  private static String source;
  private static Path extractedDirectory;

  private NativeLoader() {}

  /** Loads the natives if not done yet; throws UnsatisfiedLinkError naming everything tried. */
  public static synchronized void load() {
    if (source != null) return;
    String explicit = System.getProperty("moeblaze.jni.library");
    if (explicit != null && !explicit.isEmpty()) {
      System.load(explicit);
      source = "moeblaze.jni.library=" + explicit;
      return;
    }
    UnsatisfiedLinkError fromLibraryPath;
    try {
      System.loadLibrary(JNI_LIBRARY);
      source = "java.library.path";
      return;
    } catch (UnsatisfiedLinkError e) {
      fromLibraryPath = e;
    }
    String resourceDir = "native/" + platform() + "/";
    try {
      extractedDirectory = loadBundled(resourceDir);
      source = extractedDirectory.toString();
    } catch (IOException | UnsatisfiedLinkError e) {
      UnsatisfiedLinkError failure = new UnsatisfiedLinkError(
          "moeblaze: cannot load the native library. Tried (1) System.loadLibrary(\"" + JNI_LIBRARY
          + "\") with java.library.path=" + System.getProperty("java.library.path") + ": "
          + fromLibraryPath.getMessage() + "; (2) the libraries bundled in the jar under "
          + resourceDir + ": " + e + ". Use the moeblaze jar built for this platform, or pass"
          + " -Djava.library.path=<directory of lib" + JNI_LIBRARY + ".so> or"
          + " -Dmoeblaze.jni.library=<path of lib" + JNI_LIBRARY + ".so>.");
      failure.addSuppressed(fromLibraryPath);
      failure.addSuppressed(e);
      throw failure;
    }
  }

  /**
   * How the natives were loaded: "java.library.path", "moeblaze.jni.library=&lt;path&gt;", or the
   * directory they were extracted to; null before {@link #load()}.
   */
  public static synchronized String source() {
    return source;
  }

  /** The private directory the bundled natives were extracted to, or null if none were. */
  public static synchronized Path extractedDirectory() {
    return extractedDirectory;
  }

  /** The jar's platform directory name, e.g. "linux-x86_64". */
  public static String platform() {
    String os = System.getProperty("os.name", "").toLowerCase(Locale.ROOT);
    if (os.startsWith("linux")) {
      os = "linux";
    } else if (os.startsWith("mac") || os.startsWith("darwin")) {
      os = "macos";
    } else if (os.startsWith("windows")) {
      os = "windows";
    } else {
      os = os.replaceAll("[^a-z0-9]", "");
    }
    String arch = System.getProperty("os.arch", "").toLowerCase(Locale.ROOT);
    if (arch.equals("amd64") || arch.equals("x86_64")) {
      arch = "x86_64";
    } else if (arch.equals("aarch64") || arch.equals("arm64")) {
      arch = "aarch64";
    }
    return os + "-" + arch;
  }

  private static Path loadBundled(String resourceDir) throws IOException {
    List<String> libraries = readIndex(resourceDir);
    // createTempDirectory makes it owner-only (rwx------) on POSIX file systems, so no other user
    // can swap a library between extraction and loading.
    Path directory = Files.createTempDirectory("moeblaze-native-");
    directory.toFile().deleteOnExit();
    List<Path> extracted = new ArrayList<>();
    for (String library : libraries) {
      Path target = directory.resolve(library);
      try (InputStream in = open(resourceDir + library)) {
        Files.copy(in, target);
      }
      // Registered after the directory, so deleted before it (deleteOnExit runs in reverse).
      target.toFile().deleteOnExit();
      extracted.add(target);
    }
    for (Path library : extracted) {
      System.load(library.toAbsolutePath().toString());
    }
    return directory;
  }

  private static List<String> readIndex(String resourceDir) throws IOException {
    List<String> libraries = new ArrayList<>();
    try (BufferedReader reader = new BufferedReader(
             new InputStreamReader(open(resourceDir + INDEX_FILE), StandardCharsets.UTF_8))) {
      for (String line; (line = reader.readLine()) != null;) {
        line = line.trim();
        if (line.isEmpty()) continue;
        if (line.contains("/") || line.contains("\\") || line.startsWith(".")) {
          throw new IOException(resourceDir + INDEX_FILE + " names a bad file: " + line);
        }
        libraries.add(line);
      }
    }
    if (libraries.isEmpty()) throw new IOException(resourceDir + INDEX_FILE + " is empty");
    return libraries;
  }

  private static InputStream open(String resource) throws IOException {
    InputStream in = NativeLoader.class.getClassLoader() != null
        ? NativeLoader.class.getClassLoader().getResourceAsStream(resource)
        : ClassLoader.getSystemResourceAsStream(resource);
    if (in == null) throw new IOException("no resource " + resource + " on the class path");
    return in;
  }
}
