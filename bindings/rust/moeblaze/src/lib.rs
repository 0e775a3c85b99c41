//! Safe Rust API of libmoeblaze: the forward and backward pass of one Mixture-of-Experts layer.
//!
//! ```no_run
//! use moeblaze::{Context, Layer, LayerConfig, Weights};
//! let context = Context::cpu()?;
//! let layer = Layer::new(&context, &LayerConfig::new(64, 128, 8, 2))?;
//! let (d, h, e) = (64, 128, 8);
//! let x = vec![0.5f32; 10 * d];
//! let w_router = vec![0.01f32; e * d];
//! let (w_gate, w_up) = (vec![0.01f32; e * h * d], vec![0.01f32; e * h * d]);
//! let w_down = vec![0.01f32; e * d * h];
//! let weights =
//!     Weights { w_router: &w_router, w_gate: &w_gate, w_up: Some(&w_up), w_down: &w_down };
//! let out = layer.forward(&x, &weights, true)?;
//! let grads = layer.backward(&out.saved.unwrap(), &vec![1.0f32; 10 * d], &x, &weights, None)?;
//! # Ok::<(), moeblaze::Error>(())
//! ```
//!
//! * Errors: every call returns [`Result`]; [`Error`] carries the [`Status`] and the library's
//!   message. Nothing panics on a library failure.
//! * Host data: the slice methods run on CPU contexts (the reference backend) and check every
//!   length before calling the library. Device memory (CUDA) goes through the `unsafe` `*_raw`
//!   methods, which take the C argument structs with raw device pointers and a `cudaStream_t`.
//! * Threads: [`Context`] and [`Layer`] are `Send + Sync`. The C API's contract is that every
//!   function may be called concurrently, contexts synchronise internally and a layer is immutable
//!   after creation (concurrent executes need separate workspace and saved buffers, which the slice
//!   methods allocate per call).
//! * Lifetimes: a layer keeps what it needs of its context alive inside the library, so a
//!   [`Context`] may be dropped before the layers created on it.

mod buffer;
mod error;
mod types;

use std::ffi::{c_void, CStr};
use std::ptr::{self, NonNull};

pub use buffer::{AlignedBytes, BUFFER_ALIGNMENT};
pub use error::{last_error, Error, Result, Status};
pub use moeblaze_sys as sys;
pub use types::{Activation, Backend, Bf16, Checkpoint, DType, Element, Pass, ScoreFunction, F16};

use error::check;

/// The library's version (`major * 10000 + minor * 100 + patch`).
pub fn version() -> i32 {
    unsafe { sys::moeblaze_get_version() }
}

/// The library's ABI version; must equal [`sys::MOEBLAZE_ABI_VERSION`].
pub fn abi_version() -> i32 {
    unsafe { sys::moeblaze_get_abi_version() }
}

/// A line describing the build (version, git revision, backends).
pub fn build_info() -> String {
    unsafe {
        let ptr = sys::moeblaze_get_build_info();
        if ptr.is_null() {
            String::new()
        } else {
            CStr::from_ptr(ptr).to_string_lossy().into_owned()
        }
    }
}

fn check_abi() -> Result<()> {
    let abi = abi_version();
    if abi as u32 != sys::MOEBLAZE_ABI_VERSION {
        return Err(Error::new(
            Status::VERSION_MISMATCH,
            format!(
                "libmoeblaze has ABI version {abi}, this crate was generated for {}",
                sys::MOEBLAZE_ABI_VERSION
            ),
        ));
    }
    Ok(())
}

// ------------------------------------------------------------------------------------------------
// Context
// ------------------------------------------------------------------------------------------------

/// One backend on one device. Dropping it destroys the handle.
pub struct Context {
    raw: NonNull<sys::moeblaze_context_s>,
    backend: Backend,
    device: i32,
}

// The C API synchronises contexts internally and allows calls from any thread.
unsafe impl Send for Context {}
unsafe impl Sync for Context {}

impl Context {
    pub fn new(backend: Backend, device: i32) -> Result<Context> {
        check_abi()?;
        let mut raw: sys::moeblaze_context_t = ptr::null_mut();
        check(unsafe { sys::moeblaze_context_create(&mut raw, backend.code(), device) })?;
        let raw = NonNull::new(raw)
            .ok_or_else(|| Error::new(Status::INTERNAL, "moeblaze_context_create returned NULL"))?;
        Ok(Context {
            raw,
            backend,
            device,
        })
    }

    /// The CPU reference backend.
    pub fn cpu() -> Result<Context> {
        Context::new(Backend::Cpu, 0)
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    pub fn device(&self) -> i32 {
        self.device
    }

    /// CPU threads used by calls on this context (0: one per hardware thread).
    pub fn set_num_threads(&self, num_threads: i32) -> Result<()> {
        check(unsafe { sys::moeblaze_context_set_num_threads(self.raw.as_ptr(), num_threads) })
    }

    /// The C handle, valid while `self` lives.
    pub fn as_raw(&self) -> sys::moeblaze_context_t {
        self.raw.as_ptr()
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // Destroying a valid handle cannot fail; there is nobody to report to in drop anyway.
        let _ = unsafe { sys::moeblaze_context_destroy(self.raw.as_ptr()) };
    }
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Context({:?}:{})", self.backend, self.device)
    }
}

// ------------------------------------------------------------------------------------------------
// Layer configuration
// ------------------------------------------------------------------------------------------------

/// The shape and options of one MoE layer (`moeblaze_layer_config_t`).
#[derive(Clone, Debug, PartialEq)]
pub struct LayerConfig {
    pub d_model: i64,
    pub d_ffn: i64,
    pub num_experts: i64,
    pub top_k: i64,
    pub dtype: DType,
    pub activation: Activation,
    pub checkpoint: Checkpoint,
    pub score_function: ScoreFunction,
    pub renormalize: bool,
    pub aux_loss_coeff: f32,
    pub z_loss_coeff: f32,
    pub deterministic: bool,
}

impl LayerConfig {
    /// F32, SwiGLU, SAVE_PREACT, softmax-then-top-k, no losses, deterministic.
    pub fn new(d_model: i64, d_ffn: i64, num_experts: i64, top_k: i64) -> LayerConfig {
        LayerConfig {
            d_model,
            d_ffn,
            num_experts,
            top_k,
            dtype: DType::F32,
            activation: Activation::SwiGlu,
            checkpoint: Checkpoint::SavePreact,
            score_function: ScoreFunction::SoftmaxTopK,
            renormalize: false,
            aux_loss_coeff: 0.0,
            z_loss_coeff: 0.0,
            deterministic: true,
        }
    }

    pub fn dtype(mut self, dtype: DType) -> Self {
        self.dtype = dtype;
        self
    }

    pub fn activation(mut self, activation: Activation) -> Self {
        self.activation = activation;
        self
    }

    pub fn checkpoint(mut self, checkpoint: Checkpoint) -> Self {
        self.checkpoint = checkpoint;
        self
    }

    pub fn score_function(mut self, score_function: ScoreFunction, renormalize: bool) -> Self {
        self.score_function = score_function;
        self.renormalize = renormalize;
        self
    }

    pub fn losses(mut self, aux_loss_coeff: f32, z_loss_coeff: f32) -> Self {
        self.aux_loss_coeff = aux_loss_coeff;
        self.z_loss_coeff = z_loss_coeff;
        self
    }

    /// The C struct, initialised by `moeblaze_layer_config_init` and then filled.
    pub fn to_sys(&self) -> Result<sys::moeblaze_layer_config_t> {
        let mut c = unsafe { std::mem::zeroed::<sys::moeblaze_layer_config_t>() };
        check(unsafe { sys::moeblaze_layer_config_init(&mut c, std::mem::size_of_val(&c)) })?;
        c.dtype = self.dtype.code();
        c.d_model = self.d_model;
        c.d_ffn = self.d_ffn;
        c.num_experts = self.num_experts;
        c.top_k = self.top_k;
        c.activation = self.activation.code();
        c.checkpoint = self.checkpoint.code();
        c.score_function = self.score_function.code();
        c.renormalize = self.renormalize as i32;
        c.aux_loss_coeff = self.aux_loss_coeff;
        c.z_loss_coeff = self.z_loss_coeff;
        c.deterministic = self.deterministic as i32;
        Ok(c)
    }

    fn from_sys(c: &sys::moeblaze_layer_config_t) -> Result<LayerConfig> {
        let unknown = |what: &str, code: i32| {
            Error::new(
                Status::NOT_SUPPORTED,
                format!("library returned unknown {what} {code}"),
            )
        };
        Ok(LayerConfig {
            d_model: c.d_model,
            d_ffn: c.d_ffn,
            num_experts: c.num_experts,
            top_k: c.top_k,
            dtype: DType::from_code(c.dtype).ok_or_else(|| unknown("dtype", c.dtype))?,
            activation: Activation::from_code(c.activation)
                .ok_or_else(|| unknown("activation", c.activation))?,
            checkpoint: Checkpoint::from_code(c.checkpoint)
                .ok_or_else(|| unknown("checkpoint", c.checkpoint))?,
            score_function: ScoreFunction::from_code(c.score_function)
                .ok_or_else(|| unknown("score function", c.score_function))?,
            renormalize: c.renormalize != 0,
            aux_loss_coeff: c.aux_loss_coeff,
            z_loss_coeff: c.z_loss_coeff,
            deterministic: c.deterministic != 0,
        })
    }
}

// ------------------------------------------------------------------------------------------------
// Host-data arguments and results
// ------------------------------------------------------------------------------------------------

/// The layer's weights as host slices, row-major: w_router [E,d], w_gate/w_up [E,h,d],
/// w_down [E,d,h]. `w_up` is `None` for non-gated activations.
#[derive(Clone, Copy, Debug)]
pub struct Weights<'a, T> {
    pub w_router: &'a [T],
    pub w_gate: &'a [T],
    pub w_up: Option<&'a [T]>,
    pub w_down: &'a [T],
}

impl<'a, T> Weights<'a, T> {
    /// The expert MLPs' weights alone, for [`Layer::experts_forward`] and
    /// [`Layer::experts_backward`].
    pub fn experts(&self) -> ExpertWeights<'a, T> {
        ExpertWeights {
            w_gate: self.w_gate,
            w_up: self.w_up,
            w_down: self.w_down,
        }
    }
}

/// The expert MLPs' weights as host slices, row-major: `w_gate`/`w_up` `[E, h, d]`, `w_down`
/// `[E, d, h]`; `w_up` is `None` for non-gated activations. [`Weights::experts`] makes one from
/// a layer's.
#[derive(Clone, Copy, Debug)]
pub struct ExpertWeights<'a, T> {
    pub w_gate: &'a [T],
    pub w_up: Option<&'a [T]>,
    pub w_down: &'a [T],
}

/// Given routing for the experts-only calls, as host slices: `ids` `[T, k]` the expert of each
/// token's slot (int32, each in `0..E`, distinct within a token), `g` `[T, k]` its weight in the
/// combine (the routing dtype: f32 for f32/bf16/f16 layers, f64 for f64 ones).
#[derive(Clone, Copy, Debug)]
pub struct ExpertRouting<'a, R> {
    pub ids: &'a [i32],
    pub g: &'a [R],
}

/// The opaque state a forward pass leaves for its backward pass.
#[derive(Clone, Debug)]
pub struct Saved {
    bytes: AlignedBytes,
    num_tokens: usize,
}

impl Saved {
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }

    /// The raw bytes (for tests of the library's header checks).
    pub fn as_mut_bytes(&mut self) -> &mut [u8] {
        self.bytes.as_mut_slice()
    }
}

#[derive(Clone, Debug)]
pub struct LayerOutput<T: Element> {
    pub y: Vec<T>,
    pub logits: Vec<T::Routing>,
    pub ids: Vec<i32>,
    pub g: Vec<T::Routing>,
    pub expert_counts: Vec<i32>,
    /// {aux, z}, already multiplied by their coefficients.
    pub losses: [T::Routing; 2],
    /// `None` for inference (`training = false`).
    pub saved: Option<Saved>,
}

#[derive(Clone, Debug)]
pub struct LayerGradients<T: Element> {
    pub dx: Vec<T>,
    pub dw_router: Vec<T>,
    pub dw_gate: Vec<T>,
    pub dw_up: Option<Vec<T>>,
    pub dw_down: Vec<T>,
    pub d_logits: Vec<T::Routing>,
}

#[derive(Clone, Debug)]
pub struct ExpertsOutput<T: Element> {
    pub y: Vec<T>,
    pub expert_counts: Vec<i32>,
    pub saved: Option<Saved>,
}

#[derive(Clone, Debug)]
pub struct ExpertsGradients<T: Element> {
    pub dx: Vec<T>,
    pub dg: Vec<T::Routing>,
    pub dw_gate: Vec<T>,
    pub dw_up: Option<Vec<T>>,
    pub dw_down: Vec<T>,
}

#[derive(Clone, Debug)]
pub struct RouterOutput<R> {
    pub ids: Vec<i32>,
    pub g: Vec<R>,
    pub expert_counts: Vec<i32>,
    pub losses: [R; 2],
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RoutingIndices {
    pub expert_offsets: Vec<i32>,
    pub expert_token_indices: Vec<i32>,
    pub token_index_map: Vec<i32>,
}

fn expect_len(name: &str, actual: usize, expected: usize) -> Result<()> {
    if actual != expected {
        return Err(Error::invalid_argument(format!(
            "{name} has {actual} elements, expected {expected}"
        )));
    }
    Ok(())
}

/// `n` zeros for an output named `name`: an allocation the allocator cannot serve is an
/// `Err(OUT_OF_MEMORY)`, never a process abort (`vec!` aborts).
fn zeros<V: Copy + Default>(name: &str, n: usize) -> Result<Vec<V>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| {
        Error::new(
            Status::OUT_OF_MEMORY,
            format!(
                "{name}: cannot allocate {n} elements of {} bytes",
                std::mem::size_of::<V>()
            ),
        )
    })?;
    v.resize(n, V::default());
    Ok(v)
}

/// `num_tokens` as the C API's `int64_t`: a `usize` above `i64::MAX` would wrap to a negative
/// count (and a message about a number the caller never passed).
fn tokens_i64(num_tokens: usize) -> Result<i64> {
    i64::try_from(num_tokens).map_err(|_| {
        Error::invalid_argument(format!(
            "num_tokens = {num_tokens} does not fit the C API's int64_t"
        ))
    })
}

fn cptr<T>(slice: &[T]) -> *const c_void {
    slice.as_ptr() as *const c_void
}

fn mptr<T>(slice: &mut [T]) -> *mut c_void {
    slice.as_mut_ptr() as *mut c_void
}

fn opt_cptr<T>(slice: Option<&[T]>) -> *const c_void {
    slice.map_or(ptr::null(), cptr)
}

// ------------------------------------------------------------------------------------------------
// Layer
// ------------------------------------------------------------------------------------------------

/// An immutable, validated layer plan. Dropping it destroys the handle.
pub struct Layer {
    raw: NonNull<sys::moeblaze_layer_s>,
    config: LayerConfig,
    backend: Backend,
}

// Immutable after creation; the C API allows concurrent execution on one layer.
unsafe impl Send for Layer {}
unsafe impl Sync for Layer {}

impl Drop for Layer {
    fn drop(&mut self) {
        let _ = unsafe { sys::moeblaze_layer_destroy(self.raw.as_ptr()) };
    }
}

impl std::fmt::Debug for Layer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Layer({:?} on {:?})", self.config, self.backend)
    }
}

impl Layer {
    pub fn new(context: &Context, config: &LayerConfig) -> Result<Layer> {
        let c = config.to_sys()?;
        let mut raw: sys::moeblaze_layer_t = ptr::null_mut();
        check(unsafe { sys::moeblaze_layer_create(&mut raw, context.as_raw(), &c) })?;
        let raw = NonNull::new(raw)
            .ok_or_else(|| Error::new(Status::INTERNAL, "moeblaze_layer_create returned NULL"))?;
        // Owned at once, so that a failure below destroys the handle instead of leaking it.
        let mut layer = Layer {
            raw,
            config: config.clone(),
            backend: context.backend,
        };
        let mut validated = config.to_sys()?;
        check(unsafe { sys::moeblaze_layer_get_config(layer.as_raw(), &mut validated) })?;
        layer.config = LayerConfig::from_sys(&validated)?;
        Ok(layer)
    }

    /// The configuration as the library validated it.
    pub fn config(&self) -> &LayerConfig {
        &self.config
    }

    pub fn as_raw(&self) -> sys::moeblaze_layer_t {
        self.raw.as_ptr()
    }

    pub fn workspace_size(&self, pass: Pass, num_tokens: usize) -> Result<usize> {
        let mut bytes = 0usize;
        check(unsafe {
            sys::moeblaze_layer_workspace_size(
                self.as_raw(),
                pass.code(),
                tokens_i64(num_tokens)?,
                &mut bytes,
            )
        })?;
        Ok(bytes)
    }

    /// As [`Layer::workspace_size`], for a call made with `flags`: for a backward pass the
    /// `sys::MOEBLAZE_BACKWARD_*` bits, for a forward pass `sys::MOEBLAZE_FORWARD_WITH_SAVED` (a
    /// training forward, given a saved buffer, needs less). A flag that does not apply to `pass`
    /// is ignored.
    pub fn workspace_size_with_flags(
        &self,
        pass: Pass,
        num_tokens: usize,
        flags: u32,
    ) -> Result<usize> {
        let mut bytes = 0usize;
        check(unsafe {
            sys::moeblaze_layer_workspace_size_with_flags(
                self.as_raw(),
                pass.code(),
                tokens_i64(num_tokens)?,
                flags,
                &mut bytes,
            )
        })?;
        Ok(bytes)
    }

    pub fn saved_size(&self, pass: Pass, num_tokens: usize) -> Result<usize> {
        let mut bytes = 0usize;
        check(unsafe {
            sys::moeblaze_layer_saved_size(
                self.as_raw(),
                pass.code(),
                tokens_i64(num_tokens)?,
                &mut bytes,
            )
        })?;
        Ok(bytes)
    }

    // -- raw execute calls (any backend) ------------------------------------------------------

    /// `moeblaze_layer_forward`.
    ///
    /// # Safety
    /// Every pointer in `args` must be valid for its documented shape on the layer's device, the
    /// buffers must be as large as `*_bytes` says, and `stream` must be a valid `cudaStream_t` (or
    /// NULL) of the layer's device; the buffers must stay alive until the stream reaches the call.
    pub unsafe fn layer_forward_raw(
        &self,
        args: &sys::moeblaze_forward_args_t,
        stream: *mut c_void,
    ) -> Result<()> {
        check(sys::moeblaze_layer_forward(self.as_raw(), args, stream))
    }

    /// `moeblaze_layer_backward`.
    ///
    /// # Safety
    /// As [`Layer::layer_forward_raw`].
    pub unsafe fn layer_backward_raw(
        &self,
        args: &sys::moeblaze_backward_args_t,
        stream: *mut c_void,
    ) -> Result<()> {
        check(sys::moeblaze_layer_backward(self.as_raw(), args, stream))
    }

    /// `moeblaze_experts_forward`.
    ///
    /// # Safety
    /// As [`Layer::layer_forward_raw`].
    pub unsafe fn experts_forward_raw(
        &self,
        args: &sys::moeblaze_forward_args_t,
        stream: *mut c_void,
    ) -> Result<()> {
        check(sys::moeblaze_experts_forward(self.as_raw(), args, stream))
    }

    /// `moeblaze_experts_backward`.
    ///
    /// # Safety
    /// As [`Layer::layer_forward_raw`].
    pub unsafe fn experts_backward_raw(
        &self,
        args: &sys::moeblaze_backward_args_t,
        stream: *mut c_void,
    ) -> Result<()> {
        check(sys::moeblaze_experts_backward(self.as_raw(), args, stream))
    }

    // -- host slices (CPU backend) ----------------------------------------------------------------

    fn require_host<T: Element>(&self) -> Result<()> {
        if self.backend != Backend::Cpu {
            return Err(Error::invalid_argument(
                "host slices need a CPU context; use the *_raw methods for device memory",
            ));
        }
        if T::DTYPE != self.config.dtype {
            return Err(Error::invalid_argument(format!(
                "element type is {:?} but the layer's dtype is {:?}",
                T::DTYPE,
                self.config.dtype
            )));
        }
        Ok(())
    }

    fn dims(&self) -> (usize, usize, usize, usize) {
        let c = &self.config;
        (
            c.d_model as usize,
            c.d_ffn as usize,
            c.num_experts as usize,
            c.top_k as usize,
        )
    }

    fn num_tokens(&self, x_len: usize) -> Result<usize> {
        let d = self.config.d_model as usize;
        if x_len % d != 0 {
            return Err(Error::invalid_argument(format!(
                "x has {x_len} elements, not a multiple of d_model = {d}"
            )));
        }
        Ok(x_len / d)
    }

    fn check_expert_weights<T>(&self, weights: &ExpertWeights<T>) -> Result<()> {
        let (d, h, e, _) = self.dims();
        expect_len("w_gate", weights.w_gate.len(), e * h * d)?;
        match (self.config.activation.is_gated(), weights.w_up) {
            (true, Some(w_up)) => expect_len("w_up", w_up.len(), e * h * d)?,
            (true, None) => {
                return Err(Error::invalid_argument(format!(
                    "w_up is required for {:?}",
                    self.config.activation
                )))
            }
            (false, _) => {}
        }
        expect_len("w_down", weights.w_down.len(), e * d * h)
    }

    /// ids and g of `routing` for `t` tokens.
    fn check_expert_routing<R>(&self, routing: &ExpertRouting<R>, t: usize) -> Result<()> {
        let k = self.dims().3;
        expect_len("ids", routing.ids.len(), t * k)?;
        expect_len("g", routing.g.len(), t * k)
    }

    fn workspace(&self, pass: Pass, num_tokens: usize) -> Result<AlignedBytes> {
        AlignedBytes::try_zeroed("workspace", self.workspace_size(pass, num_tokens)?)
    }

    /// A forward's workspace: the smaller training size when the call has a saved buffer.
    fn forward_workspace(
        &self,
        pass: Pass,
        num_tokens: usize,
        training: bool,
    ) -> Result<AlignedBytes> {
        let flags = if training {
            sys::MOEBLAZE_FORWARD_WITH_SAVED
        } else {
            0
        };
        AlignedBytes::try_zeroed(
            "workspace",
            self.workspace_size_with_flags(pass, num_tokens, flags)?,
        )
    }

    fn gated_up<'a, T>(&self, w_up: Option<&'a [T]>) -> Option<&'a [T]> {
        if self.config.activation.is_gated() {
            w_up
        } else {
            None
        }
    }

    /// Router + experts on host data. x is [T,d].
    pub fn forward<T: Element>(
        &self,
        x: &[T],
        weights: &Weights<T>,
        training: bool,
    ) -> Result<LayerOutput<T>> {
        self.require_host::<T>()?;
        let (d, _, e, k) = self.dims();
        let t = self.num_tokens(x.len())?;
        expect_len("w_router", weights.w_router.len(), e * d)?;
        self.check_expert_weights(&weights.experts())?;
        let mut out = LayerOutput::<T> {
            y: zeros("y", t * d)?,
            logits: zeros("logits", t * e)?,
            ids: zeros("ids", t * k)?,
            g: zeros("g", t * k)?,
            expert_counts: vec![0; e],
            losses: [T::Routing::default(); 2],
            saved: None,
        };
        let mut saved = if training {
            Some(AlignedBytes::try_zeroed(
                "saved",
                self.saved_size(Pass::LayerForward, t)?,
            )?)
        } else {
            None
        };
        let mut workspace = self.forward_workspace(Pass::LayerForward, t, training)?;
        let mut args = forward_args()?;
        args.num_tokens = t as i64;
        args.x = cptr(x);
        args.w_router = cptr(weights.w_router);
        args.w_gate = cptr(weights.w_gate);
        args.w_up = opt_cptr(self.gated_up(weights.w_up));
        args.w_down = cptr(weights.w_down);
        args.y = mptr(&mut out.y);
        args.logits_out = mptr(&mut out.logits);
        args.ids_out = out.ids.as_mut_ptr();
        args.g_out = mptr(&mut out.g);
        args.expert_counts = out.expert_counts.as_mut_ptr();
        args.losses = mptr(&mut out.losses);
        if let Some(saved) = saved.as_mut() {
            args.saved = saved.as_mut_ptr() as *mut c_void;
            args.saved_bytes = saved.len();
        }
        args.workspace = workspace.as_mut_ptr() as *mut c_void;
        args.workspace_bytes = workspace.len();
        // Safety: every slice was length-checked above against the layer's shapes.
        unsafe { self.layer_forward_raw(&args, ptr::null_mut())? };
        out.saved = saved.map(|bytes| Saved {
            bytes,
            num_tokens: t,
        });
        Ok(out)
    }

    /// Every gradient of [`Layer::forward`]. `d_losses` defaults to {1, 1}.
    pub fn backward<T: Element>(
        &self,
        saved: &Saved,
        dy: &[T],
        x: &[T],
        weights: &Weights<T>,
        d_losses: Option<[T::Routing; 2]>,
    ) -> Result<LayerGradients<T>> {
        self.require_host::<T>()?;
        let (d, h, e, _) = self.dims();
        let t = self.num_tokens(x.len())?;
        expect_len("dy", dy.len(), t * d)?;
        expect_len("w_router", weights.w_router.len(), e * d)?;
        self.check_expert_weights(&weights.experts())?;
        if saved.num_tokens != t {
            return Err(Error::invalid_argument(format!(
                "saved state is for {} tokens, x has {t}",
                saved.num_tokens
            )));
        }
        let gated = self.config.activation.is_gated();
        let mut grads = LayerGradients::<T> {
            dx: zeros("dx", t * d)?,
            dw_router: zeros("dw_router", e * d)?,
            dw_gate: zeros("dw_gate", e * h * d)?,
            dw_up: if gated {
                Some(zeros("dw_up", e * h * d)?)
            } else {
                None
            },
            dw_down: zeros("dw_down", e * d * h)?,
            d_logits: zeros("d_logits", t * e)?,
        };
        let mut workspace = self.workspace(Pass::LayerBackward, t)?;
        let mut args = backward_args()?;
        args.num_tokens = t as i64;
        args.dy = cptr(dy);
        args.d_losses = d_losses
            .as_ref()
            .map_or(ptr::null(), |l| l.as_ptr() as *const c_void);
        args.x = cptr(x);
        args.w_router = cptr(weights.w_router);
        args.w_gate = cptr(weights.w_gate);
        args.w_up = opt_cptr(self.gated_up(weights.w_up));
        args.w_down = cptr(weights.w_down);
        args.saved = saved.bytes.as_ptr() as *const c_void;
        args.saved_bytes = saved.bytes.len();
        args.dx = mptr(&mut grads.dx);
        args.dw_router = mptr(&mut grads.dw_router);
        args.dw_gate = mptr(&mut grads.dw_gate);
        args.dw_up = grads.dw_up.as_mut().map_or(ptr::null_mut(), |v| mptr(v));
        args.dw_down = mptr(&mut grads.dw_down);
        args.d_logits = mptr(&mut grads.d_logits);
        args.workspace = workspace.as_mut_ptr() as *mut c_void;
        args.workspace_bytes = workspace.len();
        unsafe { self.layer_backward_raw(&args, ptr::null_mut())? };
        Ok(grads)
    }

    /// Expert MLPs and combine for given routing (`x` `[T, d]`); `training` keeps the state
    /// [`Layer::experts_backward`] needs.
    pub fn experts_forward<T: Element>(
        &self,
        x: &[T],
        routing: &ExpertRouting<T::Routing>,
        weights: &ExpertWeights<T>,
        training: bool,
    ) -> Result<ExpertsOutput<T>> {
        self.require_host::<T>()?;
        let (d, _, e, _) = self.dims();
        let t = self.num_tokens(x.len())?;
        self.check_expert_routing(routing, t)?;
        self.check_expert_weights(weights)?;
        let mut out = ExpertsOutput::<T> {
            y: zeros("y", t * d)?,
            expert_counts: vec![0; e],
            saved: None,
        };
        let mut saved = if training {
            Some(AlignedBytes::try_zeroed(
                "saved",
                self.saved_size(Pass::ExpertsForward, t)?,
            )?)
        } else {
            None
        };
        let mut workspace = self.forward_workspace(Pass::ExpertsForward, t, training)?;
        let mut args = forward_args()?;
        args.num_tokens = t as i64;
        args.x = cptr(x);
        args.ids = routing.ids.as_ptr();
        args.g = cptr(routing.g);
        args.w_gate = cptr(weights.w_gate);
        args.w_up = opt_cptr(self.gated_up(weights.w_up));
        args.w_down = cptr(weights.w_down);
        args.y = mptr(&mut out.y);
        args.expert_counts = out.expert_counts.as_mut_ptr();
        if let Some(saved) = saved.as_mut() {
            args.saved = saved.as_mut_ptr() as *mut c_void;
            args.saved_bytes = saved.len();
        }
        args.workspace = workspace.as_mut_ptr() as *mut c_void;
        args.workspace_bytes = workspace.len();
        unsafe { self.experts_forward_raw(&args, ptr::null_mut())? };
        out.saved = saved.map(|bytes| Saved {
            bytes,
            num_tokens: t,
        });
        Ok(out)
    }

    /// dx, dg and the expert weight gradients of [`Layer::experts_forward`], from its saved state
    /// and the same x, routing and weights.
    pub fn experts_backward<T: Element>(
        &self,
        saved: &Saved,
        dy: &[T],
        x: &[T],
        routing: &ExpertRouting<T::Routing>,
        weights: &ExpertWeights<T>,
    ) -> Result<ExpertsGradients<T>> {
        self.require_host::<T>()?;
        let (d, h, e, k) = self.dims();
        let t = self.num_tokens(x.len())?;
        expect_len("dy", dy.len(), t * d)?;
        self.check_expert_routing(routing, t)?;
        self.check_expert_weights(weights)?;
        if saved.num_tokens != t {
            return Err(Error::invalid_argument(format!(
                "saved state is for {} tokens, x has {t}",
                saved.num_tokens
            )));
        }
        let gated = self.config.activation.is_gated();
        let mut grads = ExpertsGradients::<T> {
            dx: zeros("dx", t * d)?,
            dg: zeros("dg", t * k)?,
            dw_gate: zeros("dw_gate", e * h * d)?,
            dw_up: if gated {
                Some(zeros("dw_up", e * h * d)?)
            } else {
                None
            },
            dw_down: zeros("dw_down", e * d * h)?,
        };
        let mut workspace = self.workspace(Pass::ExpertsBackward, t)?;
        let mut args = backward_args()?;
        args.num_tokens = t as i64;
        args.dy = cptr(dy);
        args.x = cptr(x);
        args.ids = routing.ids.as_ptr();
        args.g = cptr(routing.g);
        args.w_gate = cptr(weights.w_gate);
        args.w_up = opt_cptr(self.gated_up(weights.w_up));
        args.w_down = cptr(weights.w_down);
        args.saved = saved.bytes.as_ptr() as *const c_void;
        args.saved_bytes = saved.bytes.len();
        args.dx = mptr(&mut grads.dx);
        args.dg = mptr(&mut grads.dg);
        args.dw_gate = mptr(&mut grads.dw_gate);
        args.dw_up = grads.dw_up.as_mut().map_or(ptr::null_mut(), |v| mptr(v));
        args.dw_down = mptr(&mut grads.dw_down);
        args.workspace = workspace.as_mut_ptr() as *mut c_void;
        args.workspace_bytes = workspace.len();
        unsafe { self.experts_backward_raw(&args, ptr::null_mut())? };
        Ok(grads)
    }

    /// Routes logits [T,E] (routing dtype of element type `T`).
    pub fn router_forward<T: Element>(
        &self,
        logits: &[T::Routing],
    ) -> Result<RouterOutput<T::Routing>> {
        self.require_host::<T>()?;
        let (_, _, e, k) = self.dims();
        if logits.len() % e != 0 {
            return Err(Error::invalid_argument(
                "logits length is not a multiple of num_experts",
            ));
        }
        let t = logits.len() / e;
        let mut out = RouterOutput {
            ids: zeros("ids", t * k)?,
            g: zeros("g", t * k)?,
            expert_counts: vec![0; e],
            losses: [T::Routing::default(); 2],
        };
        let mut workspace = self.workspace(Pass::RouterForward, t)?;
        check(unsafe {
            sys::moeblaze_router_forward(
                self.as_raw(),
                t as i64,
                cptr(logits),
                out.ids.as_mut_ptr(),
                mptr(&mut out.g),
                out.expert_counts.as_mut_ptr(),
                mptr(&mut out.losses),
                workspace.as_mut_ptr() as *mut c_void,
                workspace.len(),
                ptr::null_mut(),
            )
        })?;
        Ok(out)
    }

    /// The routing index structures for ids [T,k].
    pub fn routing_build(&self, ids: &[i32]) -> Result<RoutingIndices> {
        if self.backend != Backend::Cpu {
            return Err(Error::invalid_argument("host slices need a CPU context"));
        }
        let (_, _, e, k) = self.dims();
        if ids.len() % k != 0 {
            return Err(Error::invalid_argument(
                "ids length is not a multiple of top_k",
            ));
        }
        let t = ids.len() / k;
        let mut out = RoutingIndices {
            expert_offsets: vec![0; e + 1],
            expert_token_indices: zeros("expert_token_indices", t * k)?,
            token_index_map: zeros("token_index_map", t * k)?,
        };
        let mut workspace = self.workspace(Pass::RoutingBuild, t)?;
        check(unsafe {
            sys::moeblaze_routing_build(
                self.as_raw(),
                t as i64,
                ids.as_ptr(),
                out.expert_offsets.as_mut_ptr(),
                out.expert_token_indices.as_mut_ptr(),
                out.token_index_map.as_mut_ptr(),
                workspace.as_mut_ptr() as *mut c_void,
                workspace.len(),
                ptr::null_mut(),
            )
        })?;
        Ok(out)
    }
}

/// `moeblaze_forward_args_t` initialised by `moeblaze_forward_args_init`.
pub fn forward_args() -> Result<sys::moeblaze_forward_args_t> {
    let mut args = unsafe { std::mem::zeroed::<sys::moeblaze_forward_args_t>() };
    check(unsafe { sys::moeblaze_forward_args_init(&mut args, std::mem::size_of_val(&args)) })?;
    Ok(args)
}

/// `moeblaze_backward_args_t` initialised by `moeblaze_backward_args_init`.
pub fn backward_args() -> Result<sys::moeblaze_backward_args_t> {
    let mut args = unsafe { std::mem::zeroed::<sys::moeblaze_backward_args_t>() };
    check(unsafe { sys::moeblaze_backward_args_init(&mut args, std::mem::size_of_val(&args)) })?;
    Ok(args)
}
