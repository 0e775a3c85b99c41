package com.moeblaze;

import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertNotNull;

import com.moeblaze.internal.NativeLoader;
import java.io.IOException;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.Paths;
import java.nio.file.attribute.PosixFilePermissions;
import java.util.List;
import java.util.stream.Collectors;
import org.junit.Test;

/**
 * Run only with the jar on the class path and no java.library.path (CTest
 * bindings_java_jar_self_contained): the natives must have come out of the jar.
 */
public class JarLoadTest {
  @Test
  public void nativesAreExtractedFromTheJar() throws IOException {
    assertEquals(com.moeblaze.internal.moeblazeConstants.MOEBLAZE_ABI_VERSION,
        Library.abiVersion()); // loads the natives
    Path directory = NativeLoader.extractedDirectory();
    assertNotNull("loaded from " + NativeLoader.source() + ", not from the jar", directory);
    System.out.println("[nativesAreExtractedFromTheJar] extracted to " + directory);
    assertEquals("rwx------",
        PosixFilePermissions.toString(Files.getPosixFilePermissions(directory)));

    String core = "libmoeblaze.so." + com.moeblaze.internal.moeblazeConstants.MOEBLAZE_ABI_VERSION;
    Path extractedCore = directory.resolve(core).toRealPath();
    Path extractedJni = directory.resolve("libmoeblaze_jni.so").toRealPath();
    // The libraries this process actually mapped: exactly the extracted copies, no other copy
    // (a build-tree libmoeblaze found through some other path would show up here).
    List<String> mapped = Files.readAllLines(Paths.get("/proc/self/maps")).stream()
        .filter(line -> line.contains("libmoeblaze"))
        .map(line -> line.substring(line.indexOf('/')))
        .distinct()
        .sorted()
        .collect(Collectors.toList());
    assertEquals(List.of(extractedCore.toString(), extractedJni.toString()), mapped);
  }

  @Test
  public void jarHoldsNativesForThisPlatform() {
    String index = "native/" + NativeLoader.platform() + "/LIBRARIES";
    assertNotNull(index + " is not in the jar", JarLoadTest.class.getClassLoader().getResource(index));
  }
}
