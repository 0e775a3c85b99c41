//! Learn a random teacher MoE layer's output by regression with plain SGD, on moeblaze's CPU
//! backend, through the safe `moeblaze` crate. Exits with an error if the loss did not fall.
use moeblaze::{Activation, Context, Layer, LayerConfig, Weights};

const D_MODEL: usize = 16;
const D_FFN: usize = 32;
const NUM_EXPERTS: usize = 4;
const TOP_K: usize = 2;
const TOKENS: usize = 256;
const STEPS: usize = 150;
const LEARNING_RATE: f32 = 1.5;

/// xorshift64*: uniform numbers in [-1, 1) without external crates.
struct Rng(u64);

impl Rng {
    fn uniform(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let bits = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40;
        bits as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }

    /// nn.Linear-style U(-1/sqrt(fan_in), 1/sqrt(fan_in)) bounds, times `scale`.
    fn weights(&mut self, n: usize, fan_in: usize, scale: f32) -> Vec<f32> {
        let bound = scale / (fan_in as f32).sqrt();
        (0..n).map(|_| self.uniform() * bound).collect()
    }

    /// Roughly standard normal (sum of uniforms), enough for inputs.
    fn normal(&mut self, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| (0..6).map(|_| self.uniform()).sum::<f32>() * 0.7)
            .collect()
    }
}

struct Params {
    w_router: Vec<f32>,
    w_gate: Vec<f32>,
    w_up: Vec<f32>,
    w_down: Vec<f32>,
}

impl Params {
    fn random(rng: &mut Rng, scale: f32) -> Params {
        let (d, h, e) = (D_MODEL, D_FFN, NUM_EXPERTS);
        Params {
            w_router: rng.weights(e * d, d, scale),
            w_gate: rng.weights(e * h * d, d, scale),
            w_up: rng.weights(e * h * d, d, scale),
            w_down: rng.weights(e * d * h, h, scale),
        }
    }

    fn weights(&self) -> Weights<'_, f32> {
        Weights {
            w_router: &self.w_router,
            w_gate: &self.w_gate,
            w_up: Some(&self.w_up),
            w_down: &self.w_down,
        }
    }
}

fn sgd(weights: &mut [f32], grads: &[f32]) {
    for (w, g) in weights.iter_mut().zip(grads) {
        *w -= LEARNING_RATE * g;
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("{}", moeblaze::build_info());
    let context = Context::cpu()?;
    let config = LayerConfig::new(
        D_MODEL as i64,
        D_FFN as i64,
        NUM_EXPERTS as i64,
        TOP_K as i64,
    )
    .activation(Activation::SwiGlu)
    .losses(0.01, 0.0);
    let layer = Layer::new(&context, &config)?;

    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let teacher = Params::random(&mut rng, 3.0);
    let mut student = Params::random(&mut rng, 1.0);
    let x = rng.normal(TOKENS * D_MODEL);
    let target = layer.forward(&x, &teacher.weights(), false)?.y;

    let mut first = 0.0f32;
    let mut last = 0.0f32;
    for step in 0..STEPS {
        let out = layer.forward(&x, &student.weights(), true)?;
        let n = out.y.len() as f32;
        let mse = out
            .y
            .iter()
            .zip(&target)
            .map(|(y, t)| (y - t) * (y - t))
            .sum::<f32>()
            / n;
        let dy: Vec<f32> = out
            .y
            .iter()
            .zip(&target)
            .map(|(y, t)| 2.0 * (y - t) / n)
            .collect();
        let saved = out
            .saved
            .as_ref()
            .expect("training forward keeps its state");
        let grads = layer.backward(saved, &dy, &x, &student.weights(), None)?;
        sgd(&mut student.w_router, &grads.dw_router);
        sgd(&mut student.w_gate, &grads.dw_gate);
        sgd(
            &mut student.w_up,
            grads.dw_up.as_ref().expect("SwiGLU is gated"),
        );
        sgd(&mut student.w_down, &grads.dw_down);
        if step == 0 {
            first = mse;
        }
        last = mse;
        if step % 25 == 0 || step == STEPS - 1 {
            println!(
                "step {step:4}  mse {mse:.6}  aux {:.5}  tokens per expert {:?}",
                out.losses[0], out.expert_counts
            );
        }
    }
    println!(
        "loss {first:.6} -> {last:.6} ({:.3} of the initial loss)",
        last / first
    );
    if !(last < 0.5 * first) {
        return Err("the loss did not fall below half of its initial value".into());
    }
    Ok(())
}
