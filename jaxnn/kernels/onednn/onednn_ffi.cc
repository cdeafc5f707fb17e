// oneDNN convolutions and matrix products as XLA FFI targets for the CPU (jaxnn.kernels.onednn loads this file's
// shared library and registers the handlers below).
//
// Layouts are jaxnn's: activations channels-last (NWC, NHWC, NDHWC), weights spatial-first (WIO, HWIO, DHWIO), so
// no transpose is needed on the JAX side. oneDNN picks its own weights layout ("any") and the weights are reordered
// into it on every call: they are small next to the activations, and a reorder is cheaper than oneDNN's fallback
// kernels for plain weights. Primitives are built once per shape and cached: building one costs milliseconds,
// running the small ones here costs less. Each calling thread has its own stream and scratchpad, because XLA runs
// the programs of several simulated devices (and independent ops of one program) on different threads at once.

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include <omp.h>
#include <xmmintrin.h>

#include "oneapi/dnnl/dnnl.hpp"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using dnnl::memory;
using Dims = memory::dims;
using I64s = ffi::Span<const int64_t>;

namespace {

dnnl::engine& Engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

dnnl::stream& ThreadStream() {
  thread_local dnnl::stream stream(Engine());
  return stream;
}

// A scratchpad that grows to the largest one this thread has needed (primitives run with scratchpad_mode::user).
memory Scratchpad(const memory::desc& desc) {
  struct Free {
    void operator()(void* p) const { std::free(p); }
  };
  thread_local std::unique_ptr<void, Free> buffer;
  thread_local size_t capacity = 0;
  size_t bytes = desc.get_size();
  if (bytes > capacity) {
    buffer.reset(std::aligned_alloc(64, (bytes + 63) / 64 * 64));
    capacity = bytes;
  }
  return memory(desc, Engine(), buffer.get());
}

memory::data_type DnnlType(ffi::DataType type) {
  switch (type) {
    case ffi::DataType::F32:
      return memory::data_type::f32;
    case ffi::DataType::BF16:
      return memory::data_type::bf16;
    default:
      throw std::invalid_argument("jaxnn oneDNN kernels take float32 and bfloat16 arrays only");
  }
}

Dims ToDims(I64s values) { return Dims(values.begin(), values.end()); }  // also a buffer's dimensions

// Channels-last activations (N, *spatial, C) as oneDNN's logical (N, C, *spatial).
memory::desc ActivationDesc(const ffi::AnyBuffer& buffer) {
  Dims d = ToDims(buffer.dimensions());
  Dims logical = {d.front(), d.back()};
  logical.insert(logical.end(), d.begin() + 1, d.end() - 1);
  static const memory::format_tag tags[] = {memory::format_tag::nwc, memory::format_tag::nhwc,
                                            memory::format_tag::ndhwc};
  return memory::desc(logical, DnnlType(buffer.element_type()), tags[d.size() - 3]);
}

// Spatial-first weights (*kernel, I, O) as oneDNN's logical (O, I, *kernel).
memory::desc WeightsDesc(const ffi::AnyBuffer& buffer) {
  Dims d = ToDims(buffer.dimensions());
  size_t rank = d.size();
  Dims logical = {d[rank - 1], d[rank - 2]};
  logical.insert(logical.end(), d.begin(), d.end() - 2);
  static const memory::format_tag tags[] = {memory::format_tag::wio, memory::format_tag::hwio,
                                            memory::format_tag::dhwio};
  return memory::desc(logical, DnnlType(buffer.element_type()), tags[rank - 3]);
}

memory::desc AnyLayout(const memory::desc& desc) {
  return memory::desc(desc.get_dims(), desc.get_data_type(), memory::format_tag::any);
}

std::string Key(const char* kind, std::initializer_list<memory::desc> descs, std::initializer_list<I64s> attrs) {
  std::ostringstream key;
  key << kind;
  for (const auto& desc : descs) {
    key << '|' << static_cast<int>(desc.get_data_type());
    for (auto d : desc.get_dims()) key << ',' << d;
    for (auto s : desc.get_strides()) key << ';' << s;
  }
  for (const auto& attr : attrs) {
    key << '|';
    for (auto v : attr) key << ',' << v;
  }
  return key.str();
}

// A primitive with the layouts it chose for its weights and the reorders between them and the user's.
struct Cached {
  dnnl::primitive primitive;
  memory::desc weights;       // the primitive's weights (or weight-gradient) layout
  memory::desc user_weights;  // jaxnn's (*kernel, I, O)
  memory::desc scratchpad;
  bool reorder;
};

template <typename Build>
const Cached& Lookup(const std::string& key, Build build) {
  static std::mutex mutex;
  static std::unordered_map<std::string, std::unique_ptr<Cached>> cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(key);
  if (it == cache.end()) it = cache.emplace(key, std::make_unique<Cached>(build())).first;
  return *it->second;
}

struct ConvGeometry {
  Dims strides, dilation, pad_lo, pad_hi;
};

ConvGeometry Geometry(I64s strides, I64s dilation, I64s pad_lo, I64s pad_hi) {
  ConvGeometry g{ToDims(strides), ToDims(dilation), ToDims(pad_lo), ToDims(pad_hi)};
  for (auto& d : g.dilation) d -= 1;  // oneDNN counts the holes between taps, lax the distance between them
  return g;
}

dnnl::primitive_attr UserScratchpad() {
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  return attr;
}

dnnl::convolution_forward::primitive_desc ForwardDesc(const memory::desc& src, const memory::desc& weights,
                                                      const memory::desc& dst, const ConvGeometry& g,
                                                      dnnl::prop_kind prop) {
  return dnnl::convolution_forward::primitive_desc(Engine(), prop, dnnl::algorithm::convolution_direct, src,
                                                   AnyLayout(weights), dst, g.strides, g.dilation, g.pad_lo,
                                                   g.pad_hi, UserScratchpad());
}

// Flush denormals to zero (FTZ, DAZ) on every thread oneDNN runs on, as XLA does on the threads that run its own
// kernels, so that both paths treat denormals alike: the OpenMP workers start with the default MXCSR. The calling
// thread has XLA's setting, and the workers get a copy of it (one parallel region per call, microseconds).
void FlushDenormals() {
  unsigned int csr = _mm_getcsr() | 0x8040;  // FTZ (bit 15) and DAZ (bit 6)
#pragma omp parallel
  _mm_setcsr(csr);
}

// Runs `cached` with `args`; the weights argument `weights_arg` is reordered from (forward, backward data) or to
// (backward weights) jaxnn's layout at `user_weights` where the primitive chose another layout.
void Run(const Cached& cached, std::unordered_map<int, memory> args, int weights_arg, void* user_weights,
         bool weights_are_output) {
  // One kernel at a time: XLA runs independent ops (two gradients of one layer, the programs of several simulated
  // devices) on different threads at once, and each calling thread would start its own OpenMP team on the same
  // cores; oversubscribed, their spinning threads slowed a 0.4 ms weight gradient to 470 ms. Every kernel already
  // uses all the cores, so waiting here costs nothing.
  static std::mutex running;
  std::lock_guard<std::mutex> lock(running);
  FlushDenormals();
  auto& stream = ThreadStream();
  memory user(cached.user_weights, Engine(), user_weights);
  memory inner = cached.reorder ? memory(cached.weights, Engine()) : user;
  if (cached.reorder && !weights_are_output) dnnl::reorder(user, inner).execute(stream, user, inner);
  args[weights_arg] = inner;
  args[DNNL_ARG_SCRATCHPAD] = Scratchpad(cached.scratchpad);
  cached.primitive.execute(stream, args);
  if (cached.reorder && weights_are_output) dnnl::reorder(inner, user).execute(stream, inner, user);
  stream.wait();
}

template <typename Fn>
ffi::Error Guard(Fn fn) {
  try {
    fn();
    return ffi::Error::Success();
  } catch (const std::exception& err) {
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("jaxnn oneDNN kernel: ") + err.what());
  }
}

ffi::Error ConvForward(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y, I64s strides,
                       I64s dilation, I64s pad_lo, I64s pad_hi) {
  return Guard([&] {
    auto src = ActivationDesc(x), weights = WeightsDesc(w), dst = ActivationDesc(*y);
    auto g = Geometry(strides, dilation, pad_lo, pad_hi);
    const Cached& c = Lookup(Key("fwd", {src, weights, dst}, {strides, dilation, pad_lo, pad_hi}), [&] {
      auto pd = ForwardDesc(src, weights, dst, g, dnnl::prop_kind::forward_inference);
      return Cached{dnnl::convolution_forward(pd), pd.weights_desc(), weights, pd.scratchpad_desc(),
                    pd.weights_desc() != weights};
    });
    Run(c, {{DNNL_ARG_SRC, memory(src, Engine(), x.untyped_data())}, {DNNL_ARG_DST, memory(dst, Engine(), y->untyped_data())}},
        DNNL_ARG_WEIGHTS, w.untyped_data(), false);
  });
}

ffi::Error ConvBackwardData(ffi::AnyBuffer dy, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> dx, I64s strides,
                            I64s dilation, I64s pad_lo, I64s pad_hi) {
  return Guard([&] {
    auto diff_dst = ActivationDesc(dy), weights = WeightsDesc(w), diff_src = ActivationDesc(*dx);
    auto g = Geometry(strides, dilation, pad_lo, pad_hi);
    const Cached& c = Lookup(Key("bwd_data", {diff_dst, weights, diff_src}, {strides, dilation, pad_lo, pad_hi}), [&] {
      auto hint = ForwardDesc(diff_src, weights, diff_dst, g, dnnl::prop_kind::forward_training);
      dnnl::convolution_backward_data::primitive_desc pd(Engine(), dnnl::algorithm::convolution_direct, diff_src,
                                                         AnyLayout(weights), diff_dst, g.strides, g.dilation,
                                                         g.pad_lo, g.pad_hi, hint, UserScratchpad());
      return Cached{dnnl::convolution_backward_data(pd), pd.weights_desc(), weights, pd.scratchpad_desc(),
                    pd.weights_desc() != weights};
    });
    Run(c,
        {{DNNL_ARG_DIFF_DST, memory(diff_dst, Engine(), dy.untyped_data())},
         {DNNL_ARG_DIFF_SRC, memory(diff_src, Engine(), dx->untyped_data())}},
        DNNL_ARG_WEIGHTS, w.untyped_data(), false);
  });
}

ffi::Error ConvBackwardWeights(ffi::AnyBuffer x, ffi::AnyBuffer dy, ffi::Result<ffi::AnyBuffer> dw, I64s strides,
                               I64s dilation, I64s pad_lo, I64s pad_hi) {
  return Guard([&] {
    auto src = ActivationDesc(x), diff_dst = ActivationDesc(dy), diff_weights = WeightsDesc(*dw);
    auto g = Geometry(strides, dilation, pad_lo, pad_hi);
    const Cached& c = Lookup(Key("bwd_w", {src, diff_dst, diff_weights}, {strides, dilation, pad_lo, pad_hi}), [&] {
      // The forward hint has the operands' dtype for its weights; the gradient itself may be wider (f32 for bf16).
      memory::desc hint_weights(diff_weights.get_dims(), src.get_data_type(), memory::format_tag::any);
      auto hint = ForwardDesc(src, hint_weights, diff_dst, g, dnnl::prop_kind::forward_training);
      dnnl::convolution_backward_weights::primitive_desc pd(Engine(), dnnl::algorithm::convolution_direct, src,
                                                            AnyLayout(diff_weights), diff_dst, g.strides,
                                                            g.dilation, g.pad_lo, g.pad_hi, hint, UserScratchpad());
      return Cached{dnnl::convolution_backward_weights(pd), pd.diff_weights_desc(), diff_weights,
                    pd.scratchpad_desc(), pd.diff_weights_desc() != diff_weights};
    });
    Run(c,
        {{DNNL_ARG_SRC, memory(src, Engine(), x.untyped_data())},
         {DNNL_ARG_DIFF_DST, memory(diff_dst, Engine(), dy.untyped_data())}},
        DNNL_ARG_DIFF_WEIGHTS, dw->untyped_data(), true);
  });
}

// A (batch, rows, cols) view of `buffer`'s last two axes, every leading axis folded into the batch; `transposed`
// reads the stored (…, cols, rows) array as its transpose through strides, without a copy.
memory::desc MatrixDesc(const ffi::AnyBuffer& buffer, bool transposed) {
  Dims d = ToDims(buffer.dimensions());
  int64_t batch = 1;
  for (size_t i = 0; i + 2 < d.size(); ++i) batch *= d[i];
  int64_t stored_rows = d[d.size() - 2], stored_cols = d[d.size() - 1];
  Dims strides = {stored_rows * stored_cols, stored_cols, 1};
  if (!transposed) return memory::desc({batch, stored_rows, stored_cols}, DnnlType(buffer.element_type()), strides);
  return memory::desc({batch, stored_cols, stored_rows}, DnnlType(buffer.element_type()),
                      Dims{stored_rows * stored_cols, 1, stored_cols});
}

ffi::Error Matmul(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::Result<ffi::AnyBuffer> c, int64_t trans_a,
                  int64_t trans_b) {
  return Guard([&] {
    auto src = MatrixDesc(a, trans_a), weights = MatrixDesc(b, trans_b), dst = MatrixDesc(*c, false);
    const Cached& cached = Lookup(Key("matmul", {src, weights, dst}, {}), [&] {
      dnnl::matmul::primitive_desc pd(Engine(), src, weights, dst, UserScratchpad());
      return Cached{dnnl::matmul(pd), weights, weights, pd.scratchpad_desc(), false};
    });
    Run(cached,
        {{DNNL_ARG_SRC, memory(src, Engine(), a.untyped_data())}, {DNNL_ARG_DST, memory(dst, Engine(), c->untyped_data())}},
        DNNL_ARG_WEIGHTS, b.untyped_data(), false);
  });
}

}  // namespace

#define JAXNN_CONV_ATTRS                 \
  .Attr<I64s>("strides")                 \
      .Attr<I64s>("dilation")            \
      .Attr<I64s>("pad_lo")              \
      .Attr<I64s>("pad_hi")

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxnn_onednn_conv_fwd, ConvForward,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  JAXNN_CONV_ATTRS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxnn_onednn_conv_bwd_data, ConvBackwardData,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  JAXNN_CONV_ATTRS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxnn_onednn_conv_bwd_weights, ConvBackwardWeights,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  JAXNN_CONV_ATTRS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxnn_onednn_matmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("trans_a")
                                  .Attr<int64_t>("trans_b"));

// 1 where oneDNN has bfloat16 kernels for this CPU (convolution forward and both backward passes, and the matrix
// product), else 0. oneDNN 3.2 builds them only for CPUs with AVX-512 (or AVX2-VNNI-2); on others creating the
// primitive throws, so the Python side asks once and keeps bf16 on XLA's kernels there.
extern "C" int jaxnn_onednn_supports_bf16() {
  try {
    auto bf16 = memory::data_type::bf16;
    memory::desc src({1, 8, 4, 4}, bf16, memory::format_tag::nhwc);
    memory::desc weights({8, 8, 3, 3}, bf16, memory::format_tag::any);
    memory::desc dst({1, 8, 4, 4}, memory::data_type::f32, memory::format_tag::nhwc);
    memory::desc diff_dst({1, 8, 4, 4}, bf16, memory::format_tag::nhwc);
    Dims strides = {1, 1}, dilation = {0, 0}, pad = {1, 1};
    dnnl::convolution_forward::primitive_desc fwd(Engine(), dnnl::prop_kind::forward_training,
                                                  dnnl::algorithm::convolution_direct, src, weights, dst, strides,
                                                  dilation, pad, pad);
    dnnl::convolution_forward::primitive_desc hint(Engine(), dnnl::prop_kind::forward_training,
                                                   dnnl::algorithm::convolution_direct, src, weights, diff_dst,
                                                   strides, dilation, pad, pad);
    dnnl::convolution_backward_data::primitive_desc(Engine(), dnnl::algorithm::convolution_direct, src, weights,
                                                    diff_dst, strides, dilation, pad, pad, hint);
    memory::desc diff_weights({8, 8, 3, 3}, memory::data_type::f32, memory::format_tag::any);
    dnnl::convolution_backward_weights::primitive_desc(Engine(), dnnl::algorithm::convolution_direct, src,
                                                       diff_weights, diff_dst, strides, dilation, pad, pad, hint);
    memory::desc a({1, 16, 16}, bf16, memory::format_tag::abc);
    for (auto out : {memory::data_type::f32, bf16}) {
      dnnl::matmul::primitive_desc(Engine(), a, a, memory::desc({1, 16, 16}, out, memory::format_tag::abc));
    }
    return 1;
  } catch (const dnnl::error&) {
    return 0;
  }
}

// The oneDNN version this library was built against, for jaxnn.kernels.onednn.info().
extern "C" const char* jaxnn_onednn_version() {
  static std::string version = [] {
    const dnnl_version_t* v = dnnl_version();
    return std::to_string(v->major) + "." + std::to_string(v->minor) + "." + std::to_string(v->patch);
  }();
  return version.c_str();
}
