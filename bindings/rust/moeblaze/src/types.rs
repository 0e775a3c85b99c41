use moeblaze_sys as sys;

/// Where a context runs.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Backend {
    Cpu,
    Cuda,
}

impl Backend {
    pub fn code(self) -> i32 {
        (match self {
            Backend::Cpu => sys::moeblaze_backend_code::MOEBLAZE_BACKEND_CPU,
            Backend::Cuda => sys::moeblaze_backend_code::MOEBLAZE_BACKEND_CUDA,
        }) as i32
    }

    pub fn from_code(code: i32) -> Option<Backend> {
        [Backend::Cpu, Backend::Cuda]
            .into_iter()
            .find(|b| b.code() == code)
    }

    /// Whether the backend is compiled in and usable on this machine.
    pub fn available(self) -> bool {
        unsafe { sys::moeblaze_backend_available(self.code()) == 1 }
    }
}

/// Storage dtype of x, the weights, y and their gradients.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum DType {
    F32,
    BF16,
    F16,
    F64,
}

impl DType {
    pub fn code(self) -> i32 {
        use sys::moeblaze_dtype_code::*;
        (match self {
            DType::F32 => MOEBLAZE_DTYPE_F32,
            DType::BF16 => MOEBLAZE_DTYPE_BF16,
            DType::F16 => MOEBLAZE_DTYPE_F16,
            DType::F64 => MOEBLAZE_DTYPE_F64,
        }) as i32
    }

    pub fn from_code(code: i32) -> Option<DType> {
        [DType::F32, DType::BF16, DType::F16, DType::F64]
            .into_iter()
            .find(|d| d.code() == code)
    }
}

/// The expert MLP's activation; `*Glu` variants are gated (use `w_up`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Activation {
    SwiGlu,
    GeGlu,
    ReGlu,
    Silu,
    Gelu,
    Relu,
    Relu2,
}

impl Activation {
    pub fn code(self) -> i32 {
        use sys::moeblaze_activation_code::*;
        (match self {
            Activation::SwiGlu => MOEBLAZE_ACTIVATION_SWIGLU,
            Activation::GeGlu => MOEBLAZE_ACTIVATION_GEGLU,
            Activation::ReGlu => MOEBLAZE_ACTIVATION_REGLU,
            Activation::Silu => MOEBLAZE_ACTIVATION_SILU,
            Activation::Gelu => MOEBLAZE_ACTIVATION_GELU,
            Activation::Relu => MOEBLAZE_ACTIVATION_RELU,
            Activation::Relu2 => MOEBLAZE_ACTIVATION_RELU2,
        }) as i32
    }

    pub fn from_code(code: i32) -> Option<Activation> {
        use Activation::*;
        [SwiGlu, GeGlu, ReGlu, Silu, Gelu, Relu, Relu2]
            .into_iter()
            .find(|a| a.code() == code)
    }

    pub fn is_gated(self) -> bool {
        matches!(
            self,
            Activation::SwiGlu | Activation::GeGlu | Activation::ReGlu
        )
    }
}

/// What the forward pass keeps for the backward pass.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Checkpoint {
    SaveAll,
    SavePreact,
    Recompute,
}

impl Checkpoint {
    pub fn code(self) -> i32 {
        use sys::moeblaze_checkpoint_code::*;
        (match self {
            Checkpoint::SaveAll => MOEBLAZE_CHECKPOINT_SAVE_ALL,
            Checkpoint::SavePreact => MOEBLAZE_CHECKPOINT_SAVE_PREACT,
            Checkpoint::Recompute => MOEBLAZE_CHECKPOINT_RECOMPUTE,
        }) as i32
    }

    pub fn from_code(code: i32) -> Option<Checkpoint> {
        use Checkpoint::*;
        [SaveAll, SavePreact, Recompute]
            .into_iter()
            .find(|c| c.code() == code)
    }
}

/// How router logits become expert ids and weights.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum ScoreFunction {
    SoftmaxTopK,
    TopKSoftmax,
    Sigmoid,
}

impl ScoreFunction {
    pub fn code(self) -> i32 {
        use sys::moeblaze_score_function_code::*;
        (match self {
            ScoreFunction::SoftmaxTopK => MOEBLAZE_SCORE_SOFTMAX_TOPK,
            ScoreFunction::TopKSoftmax => MOEBLAZE_SCORE_TOPK_SOFTMAX,
            ScoreFunction::Sigmoid => MOEBLAZE_SCORE_SIGMOID,
        }) as i32
    }

    pub fn from_code(code: i32) -> Option<ScoreFunction> {
        use ScoreFunction::*;
        [SoftmaxTopK, TopKSoftmax, Sigmoid]
            .into_iter()
            .find(|s| s.code() == code)
    }
}

/// Identifies an execute call for the workspace and saved-size queries.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Pass {
    RouterForward,
    RouterBackward,
    RoutingBuild,
    ExpertsForward,
    ExpertsBackward,
    LayerForward,
    LayerBackward,
}

impl Pass {
    pub fn code(self) -> i32 {
        use sys::moeblaze_pass_code::*;
        (match self {
            Pass::RouterForward => MOEBLAZE_PASS_ROUTER_FORWARD,
            Pass::RouterBackward => MOEBLAZE_PASS_ROUTER_BACKWARD,
            Pass::RoutingBuild => MOEBLAZE_PASS_ROUTING_BUILD,
            Pass::ExpertsForward => MOEBLAZE_PASS_EXPERTS_FORWARD,
            Pass::ExpertsBackward => MOEBLAZE_PASS_EXPERTS_BACKWARD,
            Pass::LayerForward => MOEBLAZE_PASS_LAYER_FORWARD,
            Pass::LayerBackward => MOEBLAZE_PASS_LAYER_BACKWARD,
        }) as i32
    }
}

/// bfloat16 as its bit pattern (no external crates); conversions round to nearest even.
#[repr(transparent)]
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
pub struct Bf16(pub u16);

impl Bf16 {
    pub fn from_f32(value: f32) -> Bf16 {
        let bits = value.to_bits();
        if value.is_nan() {
            return Bf16(((bits >> 16) | 0x40) as u16);
        }
        let rounded = bits.wrapping_add(0x7FFF + ((bits >> 16) & 1));
        Bf16((rounded >> 16) as u16)
    }

    pub fn to_f32(self) -> f32 {
        f32::from_bits((self.0 as u32) << 16)
    }
}

/// IEEE binary16 as its bit pattern; conversions round to nearest even.
#[repr(transparent)]
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
pub struct F16(pub u16);

impl F16 {
    pub fn from_f32(value: f32) -> F16 {
        let bits = value.to_bits();
        let sign = ((bits >> 16) & 0x8000) as u16;
        let exp = ((bits >> 23) & 0xFF) as i32;
        let mant = bits & 0x7F_FFFF;
        if exp == 0xFF {
            return F16(sign | 0x7C00 | if mant != 0 { 0x200 } else { 0 });
        }
        let e = exp - 127 + 15;
        if e >= 0x1F {
            return F16(sign | 0x7C00);
        }
        if e <= 0 {
            if e < -10 {
                return F16(sign);
            }
            let m = mant | 0x80_0000;
            let shift = (14 - e) as u32;
            let half = 1u32 << (shift - 1);
            let rest = m & ((1u32 << shift) - 1);
            let mut out = m >> shift;
            if rest > half || (rest == half && (out & 1) == 1) {
                out += 1;
            }
            return F16(sign | out as u16);
        }
        let rest = mant & 0x1FFF;
        let mut out = ((e as u32) << 10) | (mant >> 13);
        if rest > 0x1000 || (rest == 0x1000 && (out & 1) == 1) {
            out += 1; // may carry into the exponent, up to infinity: still correct
        }
        F16(sign | out as u16)
    }

    pub fn to_f32(self) -> f32 {
        let sign = ((self.0 as u32) & 0x8000) << 16;
        let exp = ((self.0 >> 10) & 0x1F) as u32;
        let mant = (self.0 & 0x3FF) as u32;
        let bits = if exp == 0 {
            if mant == 0 {
                sign
            } else {
                let value = mant as f32 * 2f32.powi(-24); // subnormal
                return if sign != 0 { -value } else { value };
            }
        } else if exp == 0x1F {
            sign | 0x7F80_0000 | (mant << 13)
        } else {
            sign | ((exp + 127 - 15) << 23) | (mant << 13)
        };
        f32::from_bits(bits)
    }
}

mod sealed {
    pub trait Sealed {}
}

/// A storage element type usable with host slices: f32, f64, [`Bf16`], [`F16`].
/// `Routing` is the routing dtype (logits, g, losses): f64 for f64 layers, else f32.
pub trait Element: Copy + Default + sealed::Sealed + Send + Sync + 'static {
    const DTYPE: DType;
    type Routing: Copy + Default + Send + Sync + 'static;
}

impl sealed::Sealed for f32 {}
impl sealed::Sealed for f64 {}
impl sealed::Sealed for Bf16 {}
impl sealed::Sealed for F16 {}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    type Routing = f32;
}
impl Element for f64 {
    const DTYPE: DType = DType::F64;
    type Routing = f64;
}
impl Element for Bf16 {
    const DTYPE: DType = DType::BF16;
    type Routing = f32;
}
impl Element for F16 {
    const DTYPE: DType = DType::F16;
    type Routing = f32;
}
