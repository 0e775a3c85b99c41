import com.moeblaze.Buffers;
import com.moeblaze.Context;
import com.moeblaze.Enums;
import com.moeblaze.Layer;
import com.moeblaze.LayerConfig;
import java.nio.ByteBuffer;
import java.nio.FloatBuffer;
import java.util.Arrays;
import java.util.Random;

/**
 * Learn a random teacher MoE layer's output by regression with plain SGD, on moeblaze's CPU
 * backend, through the com.moeblaze classes (direct ByteBuffers for host data). Exits with status 1
 * if the loss did not fall.
 */
public final class TrainMoe {
  static final int D_MODEL = 16, D_FFN = 32, NUM_EXPERTS = 4, TOP_K = 2, TOKENS = 256;
  static final int STEPS = 150;
  static final float LEARNING_RATE = 1.5f;

  /** nn.Linear-style U(-1/sqrt(fan_in), 1/sqrt(fan_in)) bounds, times scale. */
  static ByteBuffer weights(Random rng, int n, int fanIn, double scale) {
    float[] values = new float[n];
    double bound = scale / Math.sqrt(fanIn);
    for (int i = 0; i < n; i++) values[i] = (float) ((rng.nextDouble() * 2 - 1) * bound);
    return Buffers.of(values);
  }

  static ByteBuffer[] params(Random rng, double scale) {
    int d = D_MODEL, h = D_FFN, e = NUM_EXPERTS;
    return new ByteBuffer[] {weights(rng, e * d, d, scale), weights(rng, e * h * d, d, scale),
        weights(rng, e * h * d, d, scale), weights(rng, e * d * h, h, scale)};
  }

  static void sgd(ByteBuffer weights, ByteBuffer grads) {
    FloatBuffer w = weights.asFloatBuffer();
    FloatBuffer g = grads.asFloatBuffer();
    for (int i = 0; i < w.capacity(); i++) w.put(i, w.get(i) - LEARNING_RATE * g.get(i));
  }

  public static void main(String[] args) {
    Random rng = new Random(0);
    LayerConfig config = new LayerConfig(D_MODEL, D_FFN, NUM_EXPERTS, TOP_K)
        .activation(Enums.Activation.SWIGLU).losses(0.01f, 0f);
    try (Context context = Context.cpu(); Layer layer = new Layer(context, config)) {
      System.out.println(com.moeblaze.Library.buildInfo());
      ByteBuffer[] teacher = params(rng, 3.0);
      ByteBuffer[] student = params(rng, 1.0);
      float[] xs = new float[TOKENS * D_MODEL];
      for (int i = 0; i < xs.length; i++) xs[i] = (float) rng.nextGaussian();
      ByteBuffer x = Buffers.of(xs);
      float[] target = Buffers.toFloats(
          layer.forward(x, teacher[0], teacher[1], teacher[2], teacher[3], false).y);

      double first = 0, last = 0;
      for (int step = 0; step < STEPS; step++) {
        Layer.ForwardResult out = layer.forward(x, student[0], student[1], student[2],
            student[3], true);
        float[] y = Buffers.toFloats(out.y);
        float[] dy = new float[y.length];
        double mse = 0;
        for (int i = 0; i < y.length; i++) {
          double error = y[i] - target[i];
          mse += error * error;
          dy[i] = (float) (2 * error / y.length);
        }
        mse /= y.length;
        Layer.Gradients grads = layer.backward(out, Buffers.of(dy), x, student[0], student[1],
            student[2], student[3], null);
        sgd(student[0], grads.dwRouter);
        sgd(student[1], grads.dwGate);
        sgd(student[2], grads.dwUp);
        sgd(student[3], grads.dwDown);
        if (step == 0) first = mse;
        last = mse;
        if (step % 25 == 0 || step == STEPS - 1) {
          System.out.printf("step %4d  mse %.6f  aux %.5f  tokens per expert %s%n", step, mse,
              out.losses.asFloatBuffer().get(0),
              Arrays.toString(Buffers.toInts(out.expertCounts)));
        }
      }
      System.out.printf("loss %.6f -> %.6f (%.3f of the initial loss)%n", first, last,
          last / first);
      if (!(last < 0.5 * first)) {
        System.err.println("FAILED: the loss did not fall below half of its initial value");
        System.exit(1);
      }
    }
  }
}
