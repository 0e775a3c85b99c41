package com.moeblaze;

import static org.junit.Assert.assertArrayEquals;
import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertFalse;
import static org.junit.Assert.assertNotNull;
import static org.junit.Assert.assertNull;
import static org.junit.Assert.assertTrue;
import static org.junit.Assert.fail;

import java.nio.ByteBuffer;
import java.util.Random;
import org.junit.Test;

public class LayerTest {
  private static final int T = 6, D = 5, H = 4, E = 4, K = 2;

  private static long seed(String test) {
    String fixed = System.getenv("MOEBLAZE_TEST_SEED");
    long seed = fixed != null ? Long.parseLong(fixed) : System.nanoTime();
    System.out.println("[" + test + "] seed = " + seed);
    return seed;
  }

  private static double[] random(Random rng, int n, double scale) {
    double[] out = new double[n];
    for (int i = 0; i < n; i++) out[i] = (rng.nextDouble() * 2 - 1) * scale;
    return out;
  }

  private static double silu(double a) {
    return a / (1 + Math.exp(-a));
  }

  /** Per-token reference of the experts (SwiGLU) given ids and g. */
  private static double[] referenceExperts(double[] x, int[] ids, double[] g, double[] wGate,
      double[] wUp, double[] wDown) {
    double[] y = new double[T * D];
    for (int t = 0; t < T; t++) {
      for (int j = 0; j < K; j++) {
        int e = ids[t * K + j];
        double[] u = new double[H];
        for (int r = 0; r < H; r++) {
          double a = 0, b = 0;
          for (int c = 0; c < D; c++) {
            a += wGate[(e * H + r) * D + c] * x[t * D + c];
            b += wUp[(e * H + r) * D + c] * x[t * D + c];
          }
          u[r] = silu(a) * b;
        }
        for (int c = 0; c < D; c++) {
          double acc = 0;
          for (int r = 0; r < H; r++) acc += wDown[(e * D + c) * H + r] * u[r];
          y[t * D + c] += g[t * K + j] * acc;
        }
      }
    }
    return y;
  }

  @Test
  public void versionsMatchHeader() {
    assertEquals(com.moeblaze.internal.moeblazeConstants.MOEBLAZE_VERSION, Library.version());
    assertEquals(com.moeblaze.internal.moeblazeConstants.MOEBLAZE_ABI_VERSION,
        Library.abiVersion());
    assertTrue(Library.buildInfo().contains("moeblaze"));
    assertTrue(Library.backendAvailable(Enums.Backend.CPU));
  }

  @Test
  public void forwardMatchesReferenceAndGradientsMatchFiniteDifferences() {
    Random rng = new Random(seed("forward_fd"));
    double[] x = random(rng, T * D, 1), wRouter = random(rng, E * D, 1);
    double[] wGate = random(rng, E * H * D, 0.5), wUp = random(rng, E * H * D, 0.5);
    double[] wDown = random(rng, E * D * H, 0.5), r = random(rng, T * D, 1);
    try (Context context = Context.cpu();
        Layer layer = new Layer(context,
            new LayerConfig(D, H, E, K).dtype(Enums.DType.F64).losses(0.5f, 0.25f))) {
      Layer.ForwardResult out = layer.forward(Buffers.of(x), Buffers.of(wRouter),
          Buffers.of(wGate), Buffers.of(wUp), Buffers.of(wDown), true);
      double[] y = Buffers.toDoubles(out.y);
      double[] expected = referenceExperts(x, Buffers.toInts(out.ids), Buffers.toDoubles(out.g),
          wGate, wUp, wDown);
      assertArrayEquals(expected, y, 1e-12);
      int[] counts = Buffers.toInts(out.expertCounts);
      int total = 0;
      for (int c : counts) total += c;
      assertEquals(T * K, total);

      ByteBuffer dLosses = Buffers.of(0.7, 1.3);
      Layer.Gradients grads = layer.backward(out, Buffers.of(r), Buffers.of(x),
          Buffers.of(wRouter), Buffers.of(wGate), Buffers.of(wUp), Buffers.of(wDown), dLosses);
      double[][] params = {x, wRouter, wGate, wUp, wDown};
      ByteBuffer[] analytic = {grads.dx, grads.dwRouter, grads.dwGate, grads.dwUp, grads.dwDown};
      double eps = 1e-6;
      for (int p = 0; p < params.length; p++) {
        double[] g = Buffers.toDoubles(analytic[p]);
        for (int i = 0; i < params[p].length; i += 3) {
          double orig = params[p][i];
          params[p][i] = orig + eps;
          double plus = loss(layer, params, r);
          params[p][i] = orig - eps;
          double minus = loss(layer, params, r);
          params[p][i] = orig;
          double numeric = (plus - minus) / (2 * eps);
          assertEquals("param " + p + " [" + i + "]", numeric, g[i],
              1e-6 * (1 + Math.abs(numeric)));
        }
      }
    }
  }

  private static double loss(Layer layer, double[][] p, double[] r) {
    Layer.ForwardResult out = layer.forward(Buffers.of(p[0]), Buffers.of(p[1]),
        Buffers.of(p[2]), Buffers.of(p[3]), Buffers.of(p[4]), false);
    assertNull(out.saved);
    double[] y = Buffers.toDoubles(out.y);
    double[] losses = Buffers.toDoubles(out.losses);
    double sum = 0.7 * losses[0] + 1.3 * losses[1];
    for (int i = 0; i < y.length; i++) sum += y[i] * r[i];
    return sum;
  }

  @Test
  public void badConfigThrowsWithLibraryMessage() {
    try (Context context = Context.cpu()) {
      try {
        new Layer(context, new LayerConfig(0, 4, 4, 1));
        fail("expected MoeblazeException");
      } catch (MoeblazeException error) {
        assertEquals(MoeblazeException.INVALID_ARGUMENT, error.getStatus());
        assertEquals("MOEBLAZE_ERR_INVALID_ARGUMENT", error.getStatusName());
        assertTrue(error.getMessage(), error.getMessage().contains("d_model"));
      }
    }
  }

  @Test
  public void cudaWithoutCudaIsNotSupported() {
    if (Library.backendAvailable(Enums.Backend.CUDA)) return;
    try {
      new Context(Enums.Backend.CUDA, 0).close();
      fail("expected MoeblazeException");
    } catch (MoeblazeException error) {
      assertEquals(MoeblazeException.NOT_SUPPORTED, error.getStatus());
      assertFalse(error.getMessage().isEmpty());
    }
  }

  @Test
  public void routingBuildAndBadIds() {
    try (Context context = Context.cpu(); Layer layer = new Layer(context,
        new LayerConfig(D, H, E, K))) {
      ByteBuffer[] r = layer.routingBuild(Buffers.ofInts(0, 1, 1, 2, 3, 0));
      assertArrayEquals(new int[] {0, 2, 4, 5, 6}, Buffers.toInts(r[0]));
      try {
        layer.routingBuild(Buffers.ofInts(0, 9));
        fail("expected MoeblazeException");
      } catch (MoeblazeException error) {
        assertEquals(MoeblazeException.INVALID_ARGUMENT, error.getStatus());
      }
    }
  }

  @Test
  public void heapBuffersAreRefusedNamingTheArgument() {
    try (Context context = Context.cpu(); Layer layer = new Layer(context,
        new LayerConfig(D, H, E, K))) {
      ByteBuffer wRouter = Buffers.allocate(4L * E * D), wGate = Buffers.allocate(4L * E * H * D);
      ByteBuffer wUp = Buffers.allocate(4L * E * H * D), wDown = Buffers.allocate(4L * E * D * H);
      ByteBuffer heap = ByteBuffer.allocate(4 * T * D);
      try {
        layer.forward(heap, wRouter, wGate, wUp, wDown, true);
        fail("expected IllegalArgumentException");
      } catch (IllegalArgumentException error) {
        assertTrue(error.getMessage(), error.getMessage().startsWith("x is a heap ByteBuffer"));
      }
      try {
        layer.forward(Buffers.allocate(4L * T * D), wRouter, ByteBuffer.allocate(4 * E * H * D),
            wUp, wDown, true);
        fail("expected IllegalArgumentException");
      } catch (IllegalArgumentException error) {
        assertTrue(error.getMessage(), error.getMessage().startsWith("wGate is a heap"));
      }
      try {
        layer.routingBuild(ByteBuffer.allocate(4 * K));
        fail("expected IllegalArgumentException");
      } catch (IllegalArgumentException error) {
        assertTrue(error.getMessage(), error.getMessage().startsWith("ids is a heap"));
      }
    }
  }

  @Test
  public void trainingForwardNeedsLessWorkspace() {
    try (Context context = Context.cpu(); Layer layer = new Layer(context,
        new LayerConfig(D, H, E, K))) {
      for (Enums.Pass pass : new Enums.Pass[] {Enums.Pass.LAYER_FORWARD,
          Enums.Pass.EXPERTS_FORWARD}) {
        long plain = layer.workspaceSize(pass, T);
        long lean = layer.workspaceSize(pass, T, Layer.FORWARD_WITH_SAVED);
        assertTrue(lean > 0 && lean < plain);
      }
      // The flag does not apply to a backward pass: the same size.
      assertEquals(layer.workspaceSize(Enums.Pass.LAYER_BACKWARD, T),
          layer.workspaceSize(Enums.Pass.LAYER_BACKWARD, T, Layer.FORWARD_WITH_SAVED));
    }
  }

  @Test
  public void truncatedSavedBufferIsInsufficient() {
    try (Context context = Context.cpu(); Layer layer = new Layer(context,
        new LayerConfig(D, H, E, K))) {
      ByteBuffer x = Buffers.allocate(4L * T * D);
      ByteBuffer wRouter = Buffers.allocate(4L * E * D), wGate = Buffers.allocate(4L * E * H * D);
      ByteBuffer wUp = Buffers.allocate(4L * E * H * D), wDown = Buffers.allocate(4L * E * D * H);
      Layer.ForwardResult out = layer.forward(x, wRouter, wGate, wUp, wDown, true);
      assertNotNull(out.saved);
      out.saved = Buffers.allocate(out.saved.capacity() - 16);
      try {
        layer.backward(out, x, x, wRouter, wGate, wUp, wDown, null);
        fail("expected MoeblazeException");
      } catch (MoeblazeException error) {
        assertEquals(MoeblazeException.INSUFFICIENT_WORKSPACE, error.getStatus());
      }
    }
  }

  @Test
  public void closedHandlesAreRejected() {
    Context context = Context.cpu();
    Layer layer = new Layer(context, new LayerConfig(D, H, E, K));
    context.close(); // the layer keeps what it needs
    assertTrue(layer.savedSize(Enums.Pass.LAYER_FORWARD, 3) > 0);
    layer.close();
    layer.close();
    try {
      layer.savedSize(Enums.Pass.LAYER_FORWARD, 3);
      fail("expected IllegalStateException");
    } catch (IllegalStateException expected) {
      // closed
    }
  }

  @Test
  public void rawArgsStructMatchesHostApi() {
    Random rng = new Random(seed("raw_args"));
    try (Context context = Context.cpu(); Layer layer = new Layer(context,
        new LayerConfig(D, H, E, K))) {
      ByteBuffer x = Buffers.of(toFloats(random(rng, T * D, 1)));
      ByteBuffer wRouter = Buffers.of(toFloats(random(rng, E * D, 1)));
      ByteBuffer wGate = Buffers.of(toFloats(random(rng, E * H * D, 0.5)));
      ByteBuffer wUp = Buffers.of(toFloats(random(rng, E * H * D, 0.5)));
      ByteBuffer wDown = Buffers.of(toFloats(random(rng, E * D * H, 0.5)));
      float[] expected = Buffers.toFloats(layer.forward(x, wRouter, wGate, wUp, wDown, false).y);
      ByteBuffer y = Buffers.allocate(4L * T * D);
      long workspaceBytes = layer.workspaceSize(Enums.Pass.LAYER_FORWARD, T);
      ByteBuffer workspace = Buffers.allocate(workspaceBytes);
      com.moeblaze.internal.moeblaze_forward_args_t args =
          new com.moeblaze.internal.moeblaze_forward_args_t();
      try {
        assertTrue(args.getStruct_size() > 0); // set by moeblaze_forward_args_init
        args.setNum_tokens(T);
        args.setX(Buffers.address(x));
        args.setW_router(Buffers.address(wRouter));
        args.setW_gate(Buffers.address(wGate));
        args.setW_up(Buffers.address(wUp));
        args.setW_down(Buffers.address(wDown));
        args.setY(Buffers.address(y));
        args.setWorkspace(Buffers.address(workspace));
        args.setWorkspace_bytes(workspaceBytes);
        layer.forwardRaw(args, 0);
        assertArrayEquals(expected, Buffers.toFloats(y), 0f);
        args.setY(0);
        try {
          layer.forwardRaw(args, 0);
          fail("expected MoeblazeException");
        } catch (MoeblazeException error) {
          assertEquals(MoeblazeException.INVALID_ARGUMENT, error.getStatus());
          assertTrue(error.getMessage(), error.getMessage().contains("y"));
        }
      } finally {
        args.delete();
      }
    }
  }

  /**
   * The host methods pass only addresses to C. Once the JIT has compiled them, a buffer they no
   * longer use after taking its address (the workspace they allocate, or a caller's temporary) is
   * unreachable during the native call: a garbage collection then runs its Cleaner, which frees
   * (for a large buffer: unmaps) the memory the library is writing. That was a JVM crash (SIGSEGV
   * in first_gemm writing the freed 64 MiB workspace) on the first large call below.
   */
  @Test
  public void buffersStayAliveDuringNativeCallsUnderGc() throws Exception {
    Random rng = new Random(seed("gc_fence"));
    int d = 8, h = 1024, e = 4, k = 2, t = 8192; // forward workspace 64 MiB: mmap'ed by malloc
    try (Context context = Context.cpu();
        Layer tiny = new Layer(context, new LayerConfig(2, 2, 2, 1));
        Layer big = new Layer(context, new LayerConfig(d, h, e, k))) {
      ByteBuffer tx = Buffers.allocate(8), tr = Buffers.allocate(16), tw = Buffers.allocate(32);
      for (int i = 0; i < 30000; i++) tiny.forward(tx, tr, tw, tw, tw, false); // JIT-compile it
      ByteBuffer x = Buffers.of(toFloats(random(rng, t * d, 1)));
      ByteBuffer wRouter = Buffers.of(toFloats(random(rng, e * d, 1)));
      ByteBuffer wGate = Buffers.of(toFloats(random(rng, e * h * d, 0.5)));
      ByteBuffer wUp = Buffers.of(toFloats(random(rng, e * h * d, 0.5)));
      ByteBuffer wDown = Buffers.of(toFloats(random(rng, e * d * h, 0.5)));
      float[] expected = Buffers.toFloats(big.forward(x, wRouter, wGate, wUp, wDown, false).y);
      java.util.concurrent.atomic.AtomicBoolean stop =
          new java.util.concurrent.atomic.AtomicBoolean();
      Thread collector = new Thread(() -> {
        while (!stop.get()) System.gc();
      });
      collector.setDaemon(true);
      collector.start();
      try {
        for (int i = 0; i < 4; i++) {
          float[] y = Buffers.toFloats(big.forward(x, wRouter, wGate, wUp, wDown, false).y);
          assertArrayEquals("iteration " + i, expected, y, 0f);
        }
      } finally {
        stop.set(true);
        collector.join();
      }
    }
  }

  @Test
  public void badArgumentsAreNamed() {
    try (Context context = Context.cpu(); Layer layer = new Layer(context,
        new LayerConfig(D, H, E, K))) {
      try {
        layer.routingBuild(null);
        fail("expected IllegalArgumentException");
      } catch (IllegalArgumentException error) {
        assertEquals("ids is null", error.getMessage());
      }
      try {
        layer.backward(null, null, null, null, null, null, null, null);
        fail("expected NullPointerException");
      } catch (NullPointerException error) {
        assertEquals("forward is null", error.getMessage());
      }
      try {
        new Layer(context, null);
        fail("expected NullPointerException");
      } catch (NullPointerException error) {
        assertEquals("config is null", error.getMessage());
      }
      // flags is a uint32_t in C: 1L << 32 used to be truncated to 0 and accepted.
      for (long flags : new long[] {1L << 32, (1L << 32) | 4, -1}) {
        try {
          layer.workspaceSize(Enums.Pass.LAYER_BACKWARD, T, flags);
          fail("expected IllegalArgumentException for flags " + flags);
        } catch (IllegalArgumentException error) {
          assertTrue(error.getMessage(), error.getMessage().startsWith("flags = " + flags));
        }
      }
      // An output too large for a ByteBuffer names the output (logits: [T, E] = 4 GiB here).
      try (Layer wide = new Layer(context, new LayerConfig(1, 1, 1024, 1))) {
        wide.forward(Buffers.allocate(4L << 20), Buffers.allocate(4096), Buffers.allocate(4096),
            Buffers.allocate(4096), Buffers.allocate(4096), false);
        fail("expected IllegalArgumentException");
      } catch (IllegalArgumentException error) {
        assertTrue(error.getMessage(), error.getMessage().startsWith("logits: size 4294967296"));
      }
    }
  }

  /** A deleted args struct: SWIG's getters dereferenced NULL (a JVM crash), its setters did
   *  nothing. Both now throw IllegalStateException. */
  @Test
  public void deletedArgsStructsAreRefused() {
    com.moeblaze.internal.moeblaze_forward_args_t args =
        new com.moeblaze.internal.moeblaze_forward_args_t();
    args.delete();
    args.delete(); // a second delete() is a no-op
    try {
      args.getNum_tokens();
      fail("expected IllegalStateException");
    } catch (IllegalStateException error) {
      assertTrue(error.getMessage(), error.getMessage().contains("used after delete()"));
    }
    try {
      args.setNum_tokens(3);
      fail("expected IllegalStateException");
    } catch (IllegalStateException error) {
      assertTrue(error.getMessage(), error.getMessage().contains("used after delete()"));
    }
    com.moeblaze.internal.moeblaze_backward_args_t back =
        new com.moeblaze.internal.moeblaze_backward_args_t();
    back.delete();
    try {
      back.getSaved_bytes();
      fail("expected IllegalStateException");
    } catch (IllegalStateException expected) {
      // deleted
    }
  }

  private static float[] toFloats(double[] values) {
    float[] out = new float[values.length];
    for (int i = 0; i < values.length; i++) out[i] = (float) values[i];
    return out;
  }
}
