package com.moeblaze;

import com.moeblaze.internal.moeblaze;
import com.moeblaze.internal.moeblaze_backward_args_t;
import com.moeblaze.internal.moeblaze_forward_args_t;
import com.moeblaze.internal.moeblaze_layer_config_t;
import java.lang.ref.Reference;
import java.nio.ByteBuffer;
import java.util.Objects;

/**
 * An immutable MoE layer plan. Host data (CPU backend) goes in direct, native-order ByteBuffers
 * (see {@link Buffers}), read from their start; device memory (CUDA) through the *Raw methods with
 * pointers as longs. Thread-safe: a layer may execute concurrently; each call allocates its own
 * workspace and saved buffers.
 *
 * <p>The host methods pass buffer addresses to C: every buffer whose address is in flight is kept
 * strongly reachable ({@link Reference#reachabilityFence}) until the native call has returned, or
 * a garbage collection during the call could free it (its Cleaner) while the library still reads or
 * writes it.
 */
public final class Layer implements AutoCloseable {
  private long handle;
  private final LayerConfig config;
  private final Enums.Backend backend;

  /** Outputs of {@link #forward}. Buffers are direct and native-order. */
  public static final class ForwardResult {
    public ByteBuffer y; // [T,d] dtype
    public ByteBuffer logits; // [T,E] routing dtype
    public ByteBuffer ids; // [T,k] int32
    public ByteBuffer g; // [T,k] routing dtype
    public ByteBuffer expertCounts; // [E] int32
    public ByteBuffer losses; // [2] routing dtype: aux, z
    public ByteBuffer saved; // opaque; null for inference
    public long numTokens;
  }

  /** Outputs of {@link #backward}; dwUp is null for non-gated activations. */
  public static final class Gradients {
    public ByteBuffer dx;
    public ByteBuffer dwRouter;
    public ByteBuffer dwGate;
    public ByteBuffer dwUp;
    public ByteBuffer dwDown;
    public ByteBuffer dLogits;
  }

  public Layer(Context context, LayerConfig config) {
    Objects.requireNonNull(context, "context is null");
    Objects.requireNonNull(config, "config is null");
    moeblaze_layer_config_t c = new moeblaze_layer_config_t();
    try {
      c.setDtype(config.dtype.code);
      c.setD_model(config.dModel);
      c.setD_ffn(config.dFfn);
      c.setNum_experts(config.numExperts);
      c.setTop_k(config.topK);
      c.setActivation(config.activation.code);
      c.setCheckpoint(config.checkpoint.code);
      c.setScore_function(config.scoreFunction.code);
      c.setRenormalize(config.renormalize ? 1 : 0);
      c.setAux_loss_coeff(config.auxLossCoeff);
      c.setZ_loss_coeff(config.zLossCoeff);
      c.setDeterministic(config.deterministic ? 1 : 0);
      long[] out = new long[1];
      moeblaze.moeblaze_layer_create(out, context.handle(), c);
      handle = out[0];
      try {
        moeblaze.moeblaze_layer_get_config(handle, c); // the validated values
      } catch (RuntimeException error) {
        moeblaze.moeblaze_layer_destroy(handle); // not yet owned by anyone: do not leak it
        handle = 0;
        throw error;
      }
      LayerConfig validated = new LayerConfig(c.getD_model(), c.getD_ffn(), c.getNum_experts(),
          c.getTop_k());
      validated.dtype = Enums.DType.of(c.getDtype());
      validated.activation = Enums.Activation.of(c.getActivation());
      validated.checkpoint = Enums.Checkpoint.of(c.getCheckpoint());
      validated.scoreFunction = Enums.ScoreFunction.of(c.getScore_function());
      validated.renormalize = c.getRenormalize() != 0;
      validated.auxLossCoeff = c.getAux_loss_coeff();
      validated.zLossCoeff = c.getZ_loss_coeff();
      validated.deterministic = c.getDeterministic() != 0;
      this.config = validated;
      this.backend = context.getBackend();
    } finally {
      c.delete();
    }
  }

  public LayerConfig getConfig() {
    return config;
  }

  public synchronized long handle() {
    if (handle == 0) throw new IllegalStateException("Layer is closed");
    return handle;
  }

  @Override
  public synchronized void close() {
    if (handle != 0) {
      long h = handle;
      handle = 0;
      moeblaze.moeblaze_layer_destroy(h);
    }
  }

  public long workspaceSize(Enums.Pass pass, long numTokens) {
    Objects.requireNonNull(pass, "pass is null");
    long[] bytes = new long[1];
    moeblaze.moeblaze_layer_workspace_size(handle(), pass.code, numTokens, bytes);
    return bytes[0];
  }

  /**
   * As {@link #workspaceSize(Enums.Pass, long)}, for a call made with {@code flags}: for a backward
   * pass the MOEBLAZE_BACKWARD_* bits, for a forward pass {@link #FORWARD_WITH_SAVED} (a training
   * forward, given a saved buffer, needs less). A flag that does not apply to the pass is ignored.
   */
  public long workspaceSize(Enums.Pass pass, long numTokens, long flags) {
    Objects.requireNonNull(pass, "pass is null");
    // The C flags are a uint32_t: SWIG would keep the low 32 bits of anything larger (silently
    // turning 1L << 32 into 0).
    if (flags < 0 || flags > 0xFFFFFFFFL) {
      throw new IllegalArgumentException("flags = " + flags + " is not a uint32_t flag set");
    }
    long[] bytes = new long[1];
    moeblaze.moeblaze_layer_workspace_size_with_flags(handle(), pass.code, numTokens, flags, bytes);
    return bytes[0];
  }

  /** MOEBLAZE_FORWARD_WITH_SAVED: the workspace-size flag of a forward call with a saved buffer. */
  public static final long FORWARD_WITH_SAVED =
      com.moeblaze.internal.moeblazeConstants.MOEBLAZE_FORWARD_WITH_SAVED;

  public long savedSize(Enums.Pass pass, long numTokens) {
    Objects.requireNonNull(pass, "pass is null");
    long[] bytes = new long[1];
    moeblaze.moeblaze_layer_saved_size(handle(), pass.code, numTokens, bytes);
    return bytes[0];
  }

  // ---- raw (device pointers or host addresses) ------------------------------------------------

  /** moeblaze_layer_forward with caller-filled args (pointers as longs) on a cudaStream_t. */
  public void forwardRaw(moeblaze_forward_args_t args, long stream) {
    moeblaze.moeblaze_layer_forward(handle(), args, stream);
  }

  public void backwardRaw(moeblaze_backward_args_t args, long stream) {
    moeblaze.moeblaze_layer_backward(handle(), args, stream);
  }

  public void expertsForwardRaw(moeblaze_forward_args_t args, long stream) {
    moeblaze.moeblaze_experts_forward(handle(), args, stream);
  }

  public void expertsBackwardRaw(moeblaze_backward_args_t args, long stream) {
    moeblaze.moeblaze_experts_backward(handle(), args, stream);
  }

  // ---- host buffers (CPU backend) ---------------------------------------------------------------

  private void requireHost() {
    if (backend != Enums.Backend.CPU) {
      throw new IllegalStateException("host buffers need a CPU context; use the *Raw methods");
    }
  }

  private static long need(String name, ByteBuffer buffer, long bytes) {
    if (buffer == null) throw new IllegalArgumentException(name + " is null");
    if (buffer.capacity() < bytes) {
      throw new IllegalArgumentException(
          name + " has " + buffer.capacity() + " bytes, needs " + bytes);
    }
    return Buffers.address(name, buffer);
  }

  private long numTokens(ByteBuffer x) {
    long rowBytes = config.dModel * config.dtype.elementSize;
    if (x == null || x.capacity() % rowBytes != 0) {
      throw new IllegalArgumentException("x must hold whole rows of d_model elements");
    }
    return x.capacity() / rowBytes;
  }

  private long[] weightAddresses(ByteBuffer wRouter, ByteBuffer wGate, ByteBuffer wUp,
      ByteBuffer wDown) {
    long e = config.numExperts, d = config.dModel, h = config.dFfn;
    int es = config.dtype.elementSize;
    long router = wRouter == null ? 0 : need("wRouter", wRouter, e * d * es);
    long gate = need("wGate", wGate, e * h * d * es);
    long up = config.activation.gated ? need("wUp", wUp, e * h * d * es) : 0;
    long down = need("wDown", wDown, e * d * h * es);
    return new long[] {router, gate, up, down};
  }

  /** Router + experts. x [T,d]; weights as in the header; wUp ignored for non-gated. */
  public ForwardResult forward(ByteBuffer x, ByteBuffer wRouter, ByteBuffer wGate, ByteBuffer wUp,
      ByteBuffer wDown, boolean training) {
    requireHost();
    long t = numTokens(x);
    long d = config.dModel, e = config.numExperts, k = config.topK;
    int es = config.dtype.elementSize, rs = config.dtype.routingElementSize();
    long[] w = weightAddresses(wRouter, wGate, wUp, wDown);
    if (w[0] == 0) throw new IllegalArgumentException("wRouter is null");
    ForwardResult result = new ForwardResult();
    result.numTokens = t;
    result.y = Buffers.allocate("y", t * d * es);
    result.logits = Buffers.allocate("logits", t * e * rs);
    result.ids = Buffers.allocate("ids", t * k * 4);
    result.g = Buffers.allocate("g", t * k * rs);
    result.expertCounts = Buffers.allocate("expertCounts", e * 4);
    result.losses = Buffers.allocate("losses", 2L * rs);
    long savedBytes = training ? savedSize(Enums.Pass.LAYER_FORWARD, t) : 0;
    result.saved = training ? Buffers.allocate("saved", savedBytes) : null;
    long workspaceBytes =
        workspaceSize(Enums.Pass.LAYER_FORWARD, t, training ? FORWARD_WITH_SAVED : 0);
    ByteBuffer workspace = Buffers.allocate("workspace", workspaceBytes);
    moeblaze_forward_args_t args = new moeblaze_forward_args_t();
    try {
      args.setNum_tokens(t);
      args.setX(Buffers.address("x", x));
      args.setW_router(w[0]);
      args.setW_gate(w[1]);
      args.setW_up(w[2]);
      args.setW_down(w[3]);
      args.setY(Buffers.address(result.y));
      args.setLogits_out(Buffers.address(result.logits));
      args.setIds_out(Buffers.address(result.ids));
      args.setG_out(Buffers.address(result.g));
      args.setExpert_counts(Buffers.address(result.expertCounts));
      args.setLosses(Buffers.address(result.losses));
      args.setSaved(Buffers.address(result.saved));
      args.setSaved_bytes(savedBytes);
      args.setWorkspace(workspaceBytes == 0 ? 0 : Buffers.address(workspace));
      args.setWorkspace_bytes(workspaceBytes);
      moeblaze.moeblaze_layer_forward(handle(), args, 0);
    } finally {
      args.delete();
      // Only their addresses were passed: keep them alive across the native call.
      Reference.reachabilityFence(x);
      Reference.reachabilityFence(wRouter);
      Reference.reachabilityFence(wGate);
      Reference.reachabilityFence(wUp);
      Reference.reachabilityFence(wDown);
      Reference.reachabilityFence(workspace);
      Reference.reachabilityFence(result);
    }
    return result;
  }

  /** Every gradient of {@link #forward}; dLosses (2 routing-dtype values) may be null = {1, 1}. */
  public Gradients backward(ForwardResult forward, ByteBuffer dy, ByteBuffer x, ByteBuffer wRouter,
      ByteBuffer wGate, ByteBuffer wUp, ByteBuffer wDown, ByteBuffer dLosses) {
    requireHost();
    Objects.requireNonNull(forward, "forward is null");
    ByteBuffer saved = forward.saved; // read once: the field is public and mutable
    if (saved == null) {
      throw new IllegalArgumentException("forward ran with training = false: nothing saved");
    }
    long t = numTokens(x);
    long d = config.dModel, h = config.dFfn, e = config.numExperts;
    int es = config.dtype.elementSize, rs = config.dtype.routingElementSize();
    long[] w = weightAddresses(wRouter, wGate, wUp, wDown);
    Gradients grads = new Gradients();
    grads.dx = Buffers.allocate("dx", t * d * es);
    grads.dwRouter = Buffers.allocate("dwRouter", e * d * es);
    grads.dwGate = Buffers.allocate("dwGate", e * h * d * es);
    grads.dwUp = config.activation.gated ? Buffers.allocate("dwUp", e * h * d * es) : null;
    grads.dwDown = Buffers.allocate("dwDown", e * d * h * es);
    grads.dLogits = Buffers.allocate("dLogits", t * e * rs);
    long workspaceBytes = workspaceSize(Enums.Pass.LAYER_BACKWARD, t);
    ByteBuffer workspace = Buffers.allocate("workspace", workspaceBytes);
    moeblaze_backward_args_t args = new moeblaze_backward_args_t();
    try {
      args.setNum_tokens(t);
      args.setDy(need("dy", dy, t * d * es));
      args.setD_losses(dLosses == null ? 0 : need("dLosses", dLosses, 2L * rs));
      args.setX(Buffers.address("x", x));
      args.setW_router(w[0]);
      args.setW_gate(w[1]);
      args.setW_up(w[2]);
      args.setW_down(w[3]);
      args.setSaved(Buffers.address("forward.saved", saved));
      args.setSaved_bytes(saved.capacity());
      args.setDx(Buffers.address(grads.dx));
      args.setDw_router(Buffers.address(grads.dwRouter));
      args.setDw_gate(Buffers.address(grads.dwGate));
      args.setDw_up(Buffers.address(grads.dwUp));
      args.setDw_down(Buffers.address(grads.dwDown));
      args.setD_logits(Buffers.address(grads.dLogits));
      args.setWorkspace(workspaceBytes == 0 ? 0 : Buffers.address(workspace));
      args.setWorkspace_bytes(workspaceBytes);
      moeblaze.moeblaze_layer_backward(handle(), args, 0);
    } finally {
      args.delete();
      // Only their addresses were passed: keep them alive across the native call.
      Reference.reachabilityFence(saved);
      Reference.reachabilityFence(dy);
      Reference.reachabilityFence(x);
      Reference.reachabilityFence(wRouter);
      Reference.reachabilityFence(wGate);
      Reference.reachabilityFence(wUp);
      Reference.reachabilityFence(wDown);
      Reference.reachabilityFence(dLosses);
      Reference.reachabilityFence(workspace);
      Reference.reachabilityFence(grads);
    }
    return grads;
  }

  /** The routing index structures of ids [T,k] int32: {expertOffsets, tokenIndices, indexMap}. */
  public ByteBuffer[] routingBuild(ByteBuffer ids) {
    requireHost();
    long k = config.topK, e = config.numExperts;
    if (ids == null) throw new IllegalArgumentException("ids is null");
    if (ids.capacity() % (4 * k) != 0) throw new IllegalArgumentException("ids must be [T, k]");
    long t = ids.capacity() / (4 * k);
    ByteBuffer offsets = Buffers.allocate("expertOffsets", (e + 1) * 4);
    ByteBuffer tokenIndices = Buffers.allocate("tokenIndices", t * k * 4);
    ByteBuffer indexMap = Buffers.allocate("indexMap", t * k * 4);
    long workspaceBytes = workspaceSize(Enums.Pass.ROUTING_BUILD, t);
    ByteBuffer workspace = Buffers.allocate("workspace", workspaceBytes);
    try {
      moeblaze.moeblaze_routing_build(handle(), t, Buffers.address("ids", ids),
          Buffers.address(offsets), Buffers.address(tokenIndices), Buffers.address(indexMap),
          workspaceBytes == 0 ? 0 : Buffers.address(workspace), workspaceBytes, 0);
    } finally {
      // Only their addresses were passed: keep them alive across the native call.
      Reference.reachabilityFence(ids);
      Reference.reachabilityFence(offsets);
      Reference.reachabilityFence(tokenIndices);
      Reference.reachabilityFence(indexMap);
      Reference.reachabilityFence(workspace);
    }
    return new ByteBuffer[] {offsets, tokenIndices, indexMap};
  }

  @Override
  public String toString() {
    return "Layer(" + config + (handle == 0 ? ", closed" : "") + ")";
  }
}
