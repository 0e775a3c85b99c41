package com.moeblaze;

/** The shape and options of one MoE layer; defaults as the C library's, but dtype F32. */
public final class LayerConfig {
  public long dModel;
  public long dFfn;
  public long numExperts;
  public long topK = 1;
  public Enums.DType dtype = Enums.DType.F32;
  public Enums.Activation activation = Enums.Activation.SWIGLU;
  public Enums.Checkpoint checkpoint = Enums.Checkpoint.SAVE_PREACT;
  public Enums.ScoreFunction scoreFunction = Enums.ScoreFunction.SOFTMAX_TOPK;
  public boolean renormalize;
  public float auxLossCoeff;
  public float zLossCoeff;
  public boolean deterministic = true;

  public LayerConfig(long dModel, long dFfn, long numExperts, long topK) {
    this.dModel = dModel;
    this.dFfn = dFfn;
    this.numExperts = numExperts;
    this.topK = topK;
  }

  public LayerConfig dtype(Enums.DType value) {
    dtype = value;
    return this;
  }

  public LayerConfig activation(Enums.Activation value) {
    activation = value;
    return this;
  }

  public LayerConfig checkpoint(Enums.Checkpoint value) {
    checkpoint = value;
    return this;
  }

  public LayerConfig scoreFunction(Enums.ScoreFunction value, boolean renormalizeWeights) {
    scoreFunction = value;
    renormalize = renormalizeWeights;
    return this;
  }

  public LayerConfig losses(float aux, float z) {
    auxLossCoeff = aux;
    zLossCoeff = z;
    return this;
  }

  @Override
  public String toString() {
    return "LayerConfig(d_model=" + dModel + ", d_ffn=" + dFfn + ", num_experts=" + numExperts
        + ", top_k=" + topK + ", " + dtype + ", " + activation + ", " + checkpoint + ")";
  }
}
