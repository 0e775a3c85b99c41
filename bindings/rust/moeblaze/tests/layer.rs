//! The safe API against the CPU backend: runs, error mapping, gradients vs finite differences.
use moeblaze::{
    Activation, Backend, Bf16, Checkpoint, Context, ExpertRouting, ExpertWeights, Layer,
    LayerConfig, Pass, Status, Weights, F16,
};

/// xorshift64*: a dependency-free generator; the seed is printed so failures can be replayed.
struct Rng(u64);

impl Rng {
    fn from_env(test: &str) -> Rng {
        let seed = std::env::var("MOEBLAZE_TEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_nanos() as u64
                    | 1
            });
        println!("[{test}] seed = {seed}");
        Rng(seed)
    }

    fn next_f64(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let bits = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11;
        bits as f64 / (1u64 << 53) as f64 * 2.0 - 1.0 // uniform in [-1, 1)
    }

    fn vec(&mut self, n: usize, scale: f64) -> Vec<f64> {
        (0..n).map(|_| self.next_f64() * scale).collect()
    }
}

struct Problem {
    x: Vec<f64>,
    w_router: Vec<f64>,
    w_gate: Vec<f64>,
    w_up: Option<Vec<f64>>,
    w_down: Vec<f64>,
}

impl Problem {
    fn new(rng: &mut Rng, t: usize, d: usize, h: usize, e: usize, gated: bool) -> Problem {
        Problem {
            x: rng.vec(t * d, 1.0),
            w_router: rng.vec(e * d, 1.0),
            w_gate: rng.vec(e * h * d, 0.5),
            w_up: if gated {
                Some(rng.vec(e * h * d, 0.5))
            } else {
                None
            },
            w_down: rng.vec(e * d * h, 0.5),
        }
    }

    fn weights(&self) -> Weights<'_, f64> {
        Weights {
            w_router: &self.w_router,
            w_gate: &self.w_gate,
            w_up: self.w_up.as_deref(),
            w_down: &self.w_down,
        }
    }
}

#[test]
fn versions_match_header() {
    assert_eq!(
        moeblaze::abi_version() as u32,
        moeblaze::sys::MOEBLAZE_ABI_VERSION
    );
    assert_eq!(moeblaze::version() as u32, moeblaze::sys::MOEBLAZE_VERSION);
    assert!(moeblaze::build_info().contains("moeblaze"));
    assert!(Backend::Cpu.available());
}

#[test]
fn forward_backward_run_f32() {
    let mut rng = Rng::from_env("forward_backward_run_f32");
    let (t, d, h, e, k) = (32, 16, 24, 8, 2);
    let context = Context::cpu().unwrap();
    let layer = Layer::new(
        &context,
        &LayerConfig::new(d as i64, h as i64, e as i64, k as i64),
    )
    .unwrap();
    assert_eq!(layer.config().activation, Activation::SwiGlu);
    let f = |v: Vec<f64>| v.into_iter().map(|a| a as f32).collect::<Vec<f32>>();
    let x = f(rng.vec(t * d, 1.0));
    let (w_router, w_gate, w_up, w_down) = (
        f(rng.vec(e * d, 0.3)),
        f(rng.vec(e * h * d, 0.3)),
        f(rng.vec(e * h * d, 0.3)),
        f(rng.vec(e * d * h, 0.3)),
    );
    let weights = Weights {
        w_router: &w_router,
        w_gate: &w_gate,
        w_up: Some(&w_up),
        w_down: &w_down,
    };
    let out = layer.forward(&x, &weights, true).unwrap();
    assert_eq!(out.y.len(), t * d);
    assert!(out.y.iter().all(|v| v.is_finite()));
    assert!(out.ids.iter().all(|&i| (0..e as i32).contains(&i)));
    assert_eq!(out.expert_counts.iter().sum::<i32>() as usize, t * k);
    let saved = out.saved.as_ref().unwrap();
    assert_eq!(
        saved.len(),
        layer.saved_size(Pass::LayerForward, t).unwrap()
    );
    let dy = vec![1.0f32; t * d];
    let grads = layer.backward(saved, &dy, &x, &weights, None).unwrap();
    assert!(grads.dx.iter().chain(&grads.dw_gate).all(|v| v.is_finite()));
    assert!(grads.dw_down.iter().any(|&v| v != 0.0));
    // Deterministic: a second run is bitwise identical.
    let again = layer.forward(&x, &weights, false).unwrap();
    assert_eq!(again.y, out.y);
    assert!(again.saved.is_none());
}

#[test]
fn error_mapping() {
    let context = Context::cpu().unwrap();
    let err = Layer::new(&context, &LayerConfig::new(0, 4, 4, 1)).unwrap_err();
    assert_eq!(err.status, Status::INVALID_ARGUMENT);
    assert!(err.message.contains("d_model"), "{}", err.message);
    assert_eq!(err.status.name(), "MOEBLAZE_ERR_INVALID_ARGUMENT");

    let err = Layer::new(&context, &LayerConfig::new(4, 4, 4, 9)).unwrap_err();
    assert_eq!(err.status, Status::INVALID_ARGUMENT);

    if !Backend::Cuda.available() {
        let err = Context::new(Backend::Cuda, 0).unwrap_err();
        assert_eq!(err.status, Status::NOT_SUPPORTED);
        assert!(!err.message.is_empty());
    }

    let layer = Layer::new(&context, &LayerConfig::new(4, 3, 4, 2)).unwrap();
    let err = layer.routing_build(&[0, 7]).unwrap_err();
    assert_eq!(err.status, Status::INVALID_ARGUMENT);
    assert!(!err.message.is_empty());

    // Element type that does not match the layer's dtype: caught by the crate.
    let err = layer
        .forward::<f64>(
            &[0.0; 4],
            &Weights {
                w_router: &[0.0; 16],
                w_gate: &[0.0; 48],
                w_up: Some(&[0.0; 48]),
                w_down: &[0.0; 48],
            },
            true,
        )
        .unwrap_err();
    assert_eq!(err.status, Status::INVALID_ARGUMENT);

    // Corrupted saved state: the CPU backend checks the header.
    let zeros = vec![0.0f32; 48];
    let weights = Weights {
        w_router: &zeros[..16],
        w_gate: &zeros,
        w_up: Some(&zeros),
        w_down: &zeros,
    };
    let x = vec![0.5f32; 8];
    let mut saved = layer.forward(&x, &weights, true).unwrap().saved.unwrap();
    for b in saved.as_mut_bytes().iter_mut().take(16) {
        *b ^= 0xA5;
    }
    let err = layer.backward(&saved, &x, &x, &weights, None).unwrap_err();
    assert_ne!(err.status, Status::OK);
    assert!(!err.message.is_empty());
    assert!(format!("{err}").len() > 10);

    let logits = [0.0f32, f32::NAN, 0.0, 0.0];
    let err = layer.router_forward::<f32>(&logits).unwrap_err();
    assert_eq!(err.status, Status::NON_FINITE);
}

/// A batch whose saved buffer no allocator can serve (211 TB, above the 128 TiB of a 47-bit
/// address space) is an `Err(OUT_OF_MEMORY)` naming the buffer. The crate used to allocate it with
/// `handle_alloc_error`, which aborts the process (SIGABRT). The inputs are zero pages (calloc),
/// never touched: only the binding's length checks read their lengths.
#[test]
fn oversized_buffers_are_errors_not_aborts() {
    let context = Context::cpu().unwrap();
    let (d, h, e, k) = (1usize, 1usize << 20, 32usize, 32usize);
    let config =
        LayerConfig::new(d as i64, h as i64, e as i64, k as i64).checkpoint(Checkpoint::SaveAll);
    let layer = Layer::new(&context, &config).unwrap();
    let t = 1usize << 19;
    let saved_bytes = layer.saved_size(Pass::LayerForward, t).unwrap();
    assert!(saved_bytes > 1usize << 47, "{saved_bytes}");
    let x = vec![0f32; t * d];
    let w_router = vec![0f32; e * d];
    let w_gate = vec![0f32; e * h * d];
    let w_up = vec![0f32; e * h * d];
    let w_down = vec![0f32; e * d * h];
    let weights = Weights {
        w_router: &w_router,
        w_gate: &w_gate,
        w_up: Some(&w_up),
        w_down: &w_down,
    };
    let err = layer.forward(&x, &weights, true).unwrap_err();
    assert_eq!(err.status, Status::OUT_OF_MEMORY);
    assert!(err.message.starts_with("saved: "), "{}", err.message);
    // Without a saved buffer the workspace holds the activations instead.
    let err = layer.forward(&x, &weights, false).unwrap_err();
    assert_eq!(err.status, Status::OUT_OF_MEMORY);
    assert!(err.message.starts_with("workspace: "), "{}", err.message);
}

/// A token count above `i64::MAX` is refused by the crate, naming the value the caller passed; it
/// used to reach the library wrapped to a negative `int64_t` ("num_tokens = -1 must be >= 0").
#[test]
fn num_tokens_beyond_int64_are_refused_as_passed() {
    let context = Context::cpu().unwrap();
    let layer = Layer::new(&context, &LayerConfig::new(4, 3, 4, 2)).unwrap();
    for n in [usize::MAX, 1usize << 63] {
        let checks = [
            layer.workspace_size(Pass::LayerForward, n),
            layer.workspace_size_with_flags(Pass::LayerBackward, n, 0),
            layer.saved_size(Pass::LayerForward, n),
        ];
        for err in checks {
            let err = err.unwrap_err();
            assert_eq!(err.status, Status::INVALID_ARGUMENT);
            assert!(
                err.message.contains(&format!("num_tokens = {n}")),
                "{}",
                err.message
            );
        }
    }
}

fn loss(layer: &Layer, p: &Problem, r: &[f64]) -> f64 {
    let out = layer.forward(&p.x, &p.weights(), false).unwrap();
    out.y.iter().zip(r).map(|(y, r)| y * r).sum::<f64>() + 0.7 * out.losses[0] + 1.3 * out.losses[1]
}

fn finite_difference_check(activation: Activation, checkpoint: Checkpoint, test: &str) {
    let mut rng = Rng::from_env(test);
    let (t, d, h, e, k) = (5, 4, 3, 4, 2);
    let context = Context::cpu().unwrap();
    let config = LayerConfig::new(d as i64, h as i64, e as i64, k as i64)
        .dtype(moeblaze::DType::F64)
        .activation(activation)
        .checkpoint(checkpoint)
        .losses(0.5, 0.25);
    let layer = Layer::new(&context, &config).unwrap();
    let mut p = Problem::new(&mut rng, t, d, h, e, activation.is_gated());
    let r = rng.vec(t * d, 1.0);
    let out = layer.forward(&p.x, &p.weights(), true).unwrap();
    let grads = layer
        .backward(
            out.saved.as_ref().unwrap(),
            &r,
            &p.x,
            &p.weights(),
            Some([0.7, 1.3]),
        )
        .unwrap();

    let eps = 1e-6;
    let mut worst: f64 = 0.0;
    macro_rules! check_param {
        ($field:ident, $grad:expr) => {{
            let n = p.$field.len();
            for i in 0..n {
                let orig = p.$field[i];
                p.$field[i] = orig + eps;
                let plus = loss(&layer, &p, &r);
                p.$field[i] = orig - eps;
                let minus = loss(&layer, &p, &r);
                p.$field[i] = orig;
                let numeric = (plus - minus) / (2.0 * eps);
                let analytic = $grad[i];
                let err = (numeric - analytic).abs() / (1.0 + numeric.abs());
                worst = worst.max(err);
                assert!(
                    err < 1e-5,
                    "{}[{i}]: analytic {analytic} vs numeric {numeric}",
                    stringify!($field)
                );
            }
        }};
    }
    check_param!(x, grads.dx);
    check_param!(w_router, grads.dw_router);
    check_param!(w_gate, grads.dw_gate);
    check_param!(w_down, grads.dw_down);
    if let Some(dw_up) = &grads.dw_up {
        let mut w_up = p.w_up.take().unwrap();
        for i in 0..w_up.len() {
            let orig = w_up[i];
            w_up[i] = orig + eps;
            p.w_up = Some(w_up.clone());
            let plus = loss(&layer, &p, &r);
            w_up[i] = orig - eps;
            p.w_up = Some(w_up.clone());
            let minus = loss(&layer, &p, &r);
            w_up[i] = orig;
            let numeric = (plus - minus) / (2.0 * eps);
            let err = (numeric - dw_up[i]).abs() / (1.0 + numeric.abs());
            assert!(
                err < 1e-5,
                "w_up[{i}]: analytic {} vs numeric {numeric}",
                dw_up[i]
            );
        }
        p.w_up = Some(w_up);
    }
    println!("[{test}] worst relative error {worst:e}");
}

#[test]
fn gradients_match_finite_differences_swiglu() {
    finite_difference_check(Activation::SwiGlu, Checkpoint::SavePreact, "fd_swiglu");
}

#[test]
fn gradients_match_finite_differences_gelu_recompute() {
    finite_difference_check(Activation::Gelu, Checkpoint::Recompute, "fd_gelu_recompute");
}

#[test]
fn experts_and_routing() {
    let mut rng = Rng::from_env("experts_and_routing");
    let (t, d, h, e, k) = (6, 4, 3, 3, 2);
    let context = Context::cpu().unwrap();
    let layer = Layer::new(
        &context,
        &LayerConfig::new(d as i64, h as i64, e as i64, k as i64).dtype(moeblaze::DType::F64),
    )
    .unwrap();
    let p = Problem::new(&mut rng, t, d, h, e, true);
    let ids: Vec<i32> = (0..t)
        .flat_map(|i| [(i % e) as i32, ((i + 1) % e) as i32])
        .collect();
    let g: Vec<f64> = (0..t * k).map(|i| 0.25 + 0.05 * i as f64).collect();
    let routing = ExpertRouting { ids: &ids, g: &g };
    let weights = Weights {
        w_router: &p.w_router,
        w_gate: &p.w_gate,
        w_up: p.w_up.as_deref(),
        w_down: &p.w_down,
    }
    .experts();
    let forward = |training: bool| {
        layer
            .experts_forward(&p.x, &routing, &weights, training)
            .unwrap()
    };
    let out = forward(true);
    assert_eq!(out.expert_counts, vec![4, 4, 4]);
    let dy = vec![1.0; t * d];
    let grads = layer
        .experts_backward(out.saved.as_ref().unwrap(), &dy, &p.x, &routing, &weights)
        .unwrap();
    // y is linear in g: dg[t,j] = <dy_t, y2_(t,j)>, so sum_j g*dg = <dy_t, y_t>.
    for tok in 0..t {
        let lhs: f64 = (0..k).map(|j| g[tok * k + j] * grads.dg[tok * k + j]).sum();
        let rhs: f64 = (0..d).map(|c| out.y[tok * d + c]).sum();
        assert!(
            (lhs - rhs).abs() < 1e-10 * (1.0 + rhs.abs()),
            "token {tok}: {lhs} vs {rhs}"
        );
    }
    // The training forward above ran in the smaller FORWARD_WITH_SAVED workspace; inference
    // (no saved buffer) gives the same y in the plain one.
    let lean = layer
        .workspace_size_with_flags(
            Pass::ExpertsForward,
            t,
            moeblaze::sys::MOEBLAZE_FORWARD_WITH_SAVED,
        )
        .unwrap();
    assert!(lean < layer.workspace_size(Pass::ExpertsForward, t).unwrap());
    assert_eq!(forward(false).y, out.y);
    // Lengths are checked before the library is called, naming the argument.
    let short = ExpertRouting {
        ids: &ids[1..],
        g: &g,
    };
    let err = layer
        .experts_forward(&p.x, &short, &weights, false)
        .unwrap_err();
    assert_eq!(err.status, Status::INVALID_ARGUMENT);
    assert!(err.message.contains("ids"), "{}", err.message);
    let no_up = ExpertWeights {
        w_up: None,
        ..weights
    };
    let err = layer
        .experts_backward(out.saved.as_ref().unwrap(), &dy, &p.x, &routing, &no_up)
        .unwrap_err();
    assert_eq!(err.status, Status::INVALID_ARGUMENT);
    assert!(err.message.contains("w_up"), "{}", err.message);
    let indices = layer.routing_build(&ids).unwrap();
    assert_eq!(indices.expert_offsets, vec![0, 4, 8, 12]);
    for (pair, &row) in indices.token_index_map.iter().enumerate() {
        assert_eq!(
            indices.expert_token_indices[row as usize] as usize,
            pair / k
        );
    }
}

#[test]
fn layers_are_send_and_sync_and_thread_safe() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Context>();
    assert_send_sync::<Layer>();
    let mut rng = Rng::from_env("threads");
    let (t, d, h, e) = (16, 8, 8, 4);
    let layer = {
        let context = Context::cpu().unwrap(); // dropped first: the layer keeps what it needs
        Layer::new(
            &context,
            &LayerConfig::new(d as i64, h as i64, e as i64, 2).dtype(moeblaze::DType::F64),
        )
        .unwrap()
    };
    let p = Problem::new(&mut rng, t, d, h, e, true);
    let expected = layer.forward(&p.x, &p.weights(), false).unwrap().y;
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                let y = layer.forward(&p.x, &p.weights(), true).unwrap().y;
                assert_eq!(y, expected);
            });
        }
    });
}

#[test]
fn half_conversions_round_to_nearest_even() {
    assert_eq!(Bf16::from_f32(1.0).to_f32(), 1.0);
    assert_eq!(Bf16::from_f32(1.0 + 1.0 / 256.0).to_f32(), 1.0); // tie -> even
    assert_eq!(
        Bf16::from_f32(1.0 + 3.0 / 256.0).to_f32(),
        1.0 + 4.0 / 256.0
    );
    assert!(Bf16::from_f32(f32::NAN).to_f32().is_nan());
    assert_eq!(F16::from_f32(1.0).0, 0x3C00);
    assert_eq!(F16::from_f32(65504.0).to_f32(), 65504.0);
    assert_eq!(F16::from_f32(1e6).to_f32(), f32::INFINITY);
    assert_eq!(F16::from_f32(1.0 + 1.0 / 2048.0).to_f32(), 1.0); // tie -> even
    assert_eq!(F16::from_f32(2f32.powi(-24)).0, 1); // smallest subnormal
    assert_eq!(F16(1).to_f32(), 2f32.powi(-24));
    assert_eq!(F16::from_f32(-2.5).to_f32(), -2.5);
}

#[test]
fn bf16_layer_runs() {
    let mut rng = Rng::from_env("bf16");
    let (t, d, h, e) = (8, 8, 8, 4);
    let context = Context::cpu().unwrap();
    let layer = Layer::new(
        &context,
        &LayerConfig::new(d as i64, h as i64, e as i64, 2).dtype(moeblaze::DType::BF16),
    )
    .unwrap();
    let b = |v: Vec<f64>| {
        v.into_iter()
            .map(|a| Bf16::from_f32(a as f32))
            .collect::<Vec<Bf16>>()
    };
    let x = b(rng.vec(t * d, 1.0));
    let (w_router, w_gate, w_up, w_down) = (
        b(rng.vec(e * d, 0.3)),
        b(rng.vec(e * h * d, 0.3)),
        b(rng.vec(e * h * d, 0.3)),
        b(rng.vec(e * d * h, 0.3)),
    );
    let weights = Weights {
        w_router: &w_router,
        w_gate: &w_gate,
        w_up: Some(&w_up),
        w_down: &w_down,
    };
    let out = layer.forward(&x, &weights, true).unwrap();
    assert!(out.y.iter().all(|v| v.to_f32().is_finite()));
    let grads = layer
        .backward(out.saved.as_ref().unwrap(), &x, &x, &weights, None)
        .unwrap();
    assert!(grads.dx.iter().all(|v| v.to_f32().is_finite()));
}

#[test]
fn raw_args_match_slice_api() {
    let mut rng = Rng::from_env("raw_args");
    let (t, d, h, e) = (7, 8, 6, 4);
    let context = Context::cpu().unwrap();
    let layer = Layer::new(&context, &LayerConfig::new(d as i64, h as i64, e as i64, 2)).unwrap();
    let f = |v: Vec<f64>| v.into_iter().map(|a| a as f32).collect::<Vec<f32>>();
    let x = f(rng.vec(t * d, 1.0));
    let (w_router, w_gate, w_up, w_down) = (
        f(rng.vec(e * d, 0.5)),
        f(rng.vec(e * h * d, 0.5)),
        f(rng.vec(e * h * d, 0.5)),
        f(rng.vec(e * d * h, 0.5)),
    );
    let weights = Weights {
        w_router: &w_router,
        w_gate: &w_gate,
        w_up: Some(&w_up),
        w_down: &w_down,
    };
    let expected = layer.forward(&x, &weights, false).unwrap().y;

    let mut y = vec![0.0f32; t * d];
    let mut workspace =
        moeblaze::AlignedBytes::zeroed(layer.workspace_size(Pass::LayerForward, t).unwrap());
    let mut args = moeblaze::forward_args().unwrap();
    args.num_tokens = t as i64;
    args.x = x.as_ptr().cast();
    args.w_router = w_router.as_ptr().cast();
    args.w_gate = w_gate.as_ptr().cast();
    args.w_up = w_up.as_ptr().cast();
    args.w_down = w_down.as_ptr().cast();
    args.y = y.as_mut_ptr().cast();
    args.workspace = workspace.as_mut_ptr().cast();
    args.workspace_bytes = workspace.len();
    unsafe {
        layer
            .layer_forward_raw(&args, std::ptr::null_mut())
            .unwrap()
    };
    assert_eq!(y, expected);

    args.workspace_bytes = 0;
    if !workspace.is_empty() {
        let err = unsafe { layer.layer_forward_raw(&args, std::ptr::null_mut()) }.unwrap_err();
        assert_eq!(err.status, Status::INSUFFICIENT_WORKSPACE);
    }
}
