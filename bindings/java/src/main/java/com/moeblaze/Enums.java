package com.moeblaze;

/** Names for the header's integer codes (values frozen by include/moeblaze.h). */
public final class Enums {
  private Enums() {}

  /** Where a context runs. */
  public enum Backend {
    CPU(1),
    CUDA(2);

    public final int code;

    Backend(int code) {
      this.code = code;
    }

    static Backend of(int code) {
      for (Backend value : values()) if (value.code == code) return value;
      throw new IllegalArgumentException("unknown backend code " + code);
    }
  }

  /** Storage dtype; {@link #elementSize} bytes per element. */
  public enum DType {
    F32(0, 4),
    BF16(1, 2),
    F16(2, 2),
    F64(3, 8);

    public final int code;
    public final int elementSize;

    DType(int code, int elementSize) {
      this.code = code;
      this.elementSize = elementSize;
    }

    /** Bytes per element of the routing dtype (logits, g, losses): 8 for F64, else 4. */
    public int routingElementSize() {
      return this == F64 ? 8 : 4;
    }

    static DType of(int code) {
      for (DType value : values()) if (value.code == code) return value;
      throw new IllegalArgumentException("unknown dtype code " + code);
    }
  }

  public enum Activation {
    SWIGLU(0, true),
    GEGLU(1, true),
    REGLU(2, true),
    SILU(3, false),
    GELU(4, false),
    RELU(5, false),
    RELU2(6, false);

    public final int code;
    public final boolean gated;

    Activation(int code, boolean gated) {
      this.code = code;
      this.gated = gated;
    }

    static Activation of(int code) {
      for (Activation value : values()) if (value.code == code) return value;
      throw new IllegalArgumentException("unknown activation code " + code);
    }
  }

  public enum Checkpoint {
    SAVE_ALL(0),
    SAVE_PREACT(1),
    RECOMPUTE(2);

    public final int code;

    Checkpoint(int code) {
      this.code = code;
    }

    static Checkpoint of(int code) {
      for (Checkpoint value : values()) if (value.code == code) return value;
      throw new IllegalArgumentException("unknown checkpoint code " + code);
    }
  }

  public enum ScoreFunction {
    SOFTMAX_TOPK(0),
    TOPK_SOFTMAX(1),
    SIGMOID(2);

    public final int code;

    ScoreFunction(int code) {
      this.code = code;
    }

    static ScoreFunction of(int code) {
      for (ScoreFunction value : values()) if (value.code == code) return value;
      throw new IllegalArgumentException("unknown score function code " + code);
    }
  }

  /** Identifies an execute call for the size queries. */
  public enum Pass {
    ROUTER_FORWARD(0),
    ROUTER_BACKWARD(1),
    ROUTING_BUILD(2),
    EXPERTS_FORWARD(3),
    EXPERTS_BACKWARD(4),
    LAYER_FORWARD(5),
    LAYER_BACKWARD(6);

    public final int code;

    Pass(int code) {
      this.code = code;
    }
  }
}
