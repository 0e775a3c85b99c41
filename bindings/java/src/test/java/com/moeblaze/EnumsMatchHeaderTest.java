package com.moeblaze;

import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertTrue;

import com.moeblaze.internal.moeblaze_activation_code;
import com.moeblaze.internal.moeblaze_backend_code;
import com.moeblaze.internal.moeblaze_checkpoint_code;
import com.moeblaze.internal.moeblaze_dtype_code;
import com.moeblaze.internal.moeblaze_pass_code;
import com.moeblaze.internal.moeblaze_score_function_code;
import java.lang.reflect.Field;
import java.lang.reflect.Modifier;
import java.util.Map;
import java.util.TreeMap;
import org.junit.Test;

/**
 * The hand-written enums of {@link Enums} against include/moeblaze.h, through the classes SWIG
 * generates from the header (com.moeblaze.internal.moeblaze_*_code): every header code has a Java
 * constant of the same name and value and no Java constant lacks one. Fails when either side
 * gains, loses or renumbers a code.
 */
public class EnumsMatchHeaderTest {
  /** Header name (prefix stripped) -> code, from one SWIG typesafe enum class. */
  private static Map<String, Integer> headerCodes(Class<?> swigEnum, String prefix)
      throws IllegalAccessException {
    Map<String, Integer> codes = new TreeMap<>();
    for (Field field : swigEnum.getFields()) {
      if (!Modifier.isStatic(field.getModifiers()) || field.getType() != swigEnum) continue;
      assertTrue(field.getName() + " lacks " + prefix, field.getName().startsWith(prefix));
      Object value = field.get(null);
      int code;
      try {
        code = (Integer) swigEnum.getMethod("swigValue").invoke(value);
      } catch (ReflectiveOperationException e) {
        throw new AssertionError(e);
      }
      codes.put(field.getName().substring(prefix.length()), code);
    }
    assertTrue(swigEnum.getSimpleName() + " has no codes", !codes.isEmpty());
    return codes;
  }

  private static <E extends Enum<E>> Map<String, Integer> javaCodes(
      Class<E> javaEnum, java.util.function.ToIntFunction<E> code) {
    Map<String, Integer> codes = new TreeMap<>();
    for (E value : javaEnum.getEnumConstants()) codes.put(value.name(), code.applyAsInt(value));
    return codes;
  }

  @Test
  public void backendsMatchHeader() throws Exception {
    assertEquals(headerCodes(moeblaze_backend_code.class, "MOEBLAZE_BACKEND_"),
        javaCodes(Enums.Backend.class, v -> v.code));
  }

  @Test
  public void dtypesMatchHeader() throws Exception {
    assertEquals(headerCodes(moeblaze_dtype_code.class, "MOEBLAZE_DTYPE_"),
        javaCodes(Enums.DType.class, v -> v.code));
  }

  @Test
  public void activationsMatchHeader() throws Exception {
    assertEquals(headerCodes(moeblaze_activation_code.class, "MOEBLAZE_ACTIVATION_"),
        javaCodes(Enums.Activation.class, v -> v.code));
    // The header's rule: the gated activations are the *GLU ones (they use w_up).
    for (Enums.Activation value : Enums.Activation.values()) {
      assertEquals(value.name(), value.name().endsWith("GLU"), value.gated);
    }
  }

  @Test
  public void checkpointsMatchHeader() throws Exception {
    assertEquals(headerCodes(moeblaze_checkpoint_code.class, "MOEBLAZE_CHECKPOINT_"),
        javaCodes(Enums.Checkpoint.class, v -> v.code));
  }

  @Test
  public void scoreFunctionsMatchHeader() throws Exception {
    assertEquals(headerCodes(moeblaze_score_function_code.class, "MOEBLAZE_SCORE_"),
        javaCodes(Enums.ScoreFunction.class, v -> v.code));
  }

  @Test
  public void passesMatchHeader() throws Exception {
    assertEquals(headerCodes(moeblaze_pass_code.class, "MOEBLAZE_PASS_"),
        javaCodes(Enums.Pass.class, v -> v.code));
  }
}
