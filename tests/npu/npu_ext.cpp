// A test-only accelerator for ckptfmt's device paths: torch's PrivateUse1 backend
// (renamed to "npu" by tests/npu/__init__.py) with host memory underneath.
//
// What it models, so that the tests exercise what a GPU would:
//
// * two devices (npu:0, npu:1), a current device and a current stream per device
//   per thread, as CUDA has;
// * device memory from malloc, filled with junk when allocated (a load that leaves
//   bytes unwritten shows up);
// * pinned host memory, from its own allocator, that tensor.is_pinned() recognises
//   (torch.empty(n, pin_memory=True) reaches it through the PrivateUse1 hooks);
// * asynchronous copies: a non_blocking copy between pinned host memory and the
//   device is queued on the device's current stream and run by that stream's own
//   worker thread, after an adjustable delay.  Until an event recorded after it
//   completes, or the stream or device is synchronized, the host bytes are stale,
//   so a missing or misplaced fence makes a test fail instead of passing by luck.
//   Copies from pageable memory are synchronous, as CUDA's are;
// * stream order: every other operation on the device (kernels, synchronous
//   copies, reading a scalar) first waits for the queued copies of every stream
//   (stricter than CUDA, never looser);
// * events recorded on a stream, queried, synchronized, waited for by another
//   stream, and timed; a default generator per device (CPU Philox underneath);
// * a switch (set_enabled) that makes the backend report no devices, for the
//   rest of a test session once the device tests are done.
//
// Every other aten operator runs on the CPU through torch's boxed CPU fallback.

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/Generator.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/ops/_local_scalar_dense_native.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_cpu_dispatch.h>
#include <ATen/ops/copy_native.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/resize_native.h>
#include <ATen/ops/set_cpu_dispatch.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/csrc/Generator.h>
#include <torch/library.h>

#include <pybind11/pybind11.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace npu {

constexpr c10::DeviceIndex kDevices = 2;
constexpr c10::DeviceType kType = c10::DeviceType::PrivateUse1;
constexpr unsigned char kJunk = 0xCB;

std::atomic<bool> g_enabled{true};
std::atomic<int64_t> g_delay_us{0};
std::atomic<int64_t> g_async_copies{0};
std::atomic<int64_t> g_sync_copies{0};
std::atomic<int64_t> g_events_recorded{0};
std::atomic<int64_t> g_event_waits{0};

thread_local c10::DeviceIndex t_device = 0;
thread_local c10::StreamId t_stream[kDevices] = {0, 0};
std::atomic<c10::StreamId> g_next_stream{1};

void check_index(c10::DeviceIndex i) {
  TORCH_CHECK(i >= 0 && i < kDevices, "npu: invalid device index ", static_cast<int>(i),
              " (there are ", static_cast<int>(kDevices), " devices)");
}

c10::DeviceIndex current_device() { return t_device; }

void set_device(c10::DeviceIndex i) {
  check_index(i);
  t_device = i;
}

// ---------------------------------------------------------------------------
// streams: one FIFO queue and worker thread per (device, stream id), made on first use
// and never destroyed (a detached thread blocked on its condition variable at exit).

class Queue {
 public:
  Queue() : worker_([this] { run(); }) { worker_.detach(); }

  // Queue `fn`; the sequence number an event recorded now would wait for.
  uint64_t push(std::function<void()> fn) {
    collect();
    std::lock_guard<std::mutex> g(m_);
    q_.emplace_back(std::move(fn), ++enqueued_);
    work_.notify_one();
    return enqueued_;
  }

  uint64_t enqueued() {
    std::lock_guard<std::mutex> g(m_);
    return enqueued_;
  }

  bool reached(uint64_t seq) {
    std::lock_guard<std::mutex> g(m_);
    return completed_ >= seq;
  }

  // Block until task `seq` has run.  Called from a caller's thread: the finished
  // tasks (and the tensors they hold) are destroyed here, never on the worker,
  // whose thread must not need the GIL to drop the last reference to a tensor.
  void wait(uint64_t seq) {
    wait_on_worker(seq);
    collect();
    std::string error;
    {
      std::lock_guard<std::mutex> g(m_);
      error.swap(error_);
    }
    // like a CUDA error from an asynchronous copy: reported by the next synchronize
    TORCH_CHECK(error.empty(), "npu: an asynchronous copy failed: ", error);
  }

  void drain() { wait(enqueued()); }

  // The same, for use on another queue's worker (stream.wait_event): no collection.
  void wait_on_worker(uint64_t seq) {
    std::unique_lock<std::mutex> g(m_);
    done_.wait(g, [&] { return completed_ >= seq; });
  }

 private:
  void collect() {
    std::vector<std::function<void()>> dead;
    {
      std::lock_guard<std::mutex> g(m_);
      dead.swap(finished_);
    }
  }

  void run() {
    for (;;) {
      std::pair<std::function<void()>, uint64_t> task;
      {
        std::unique_lock<std::mutex> g(m_);
        work_.wait(g, [&] { return !q_.empty(); });
        task = std::move(q_.front());
        q_.pop_front();
      }
      std::string error;
      try {
        task.first();
      } catch (const std::exception& e) {
        error = e.what();
      }
      std::lock_guard<std::mutex> g(m_);
      if (!error.empty() && error_.empty()) {
        error_ = error;
      }
      completed_ = task.second;
      finished_.push_back(std::move(task.first));
      done_.notify_all();
    }
  }

  std::mutex m_;
  std::condition_variable work_, done_;
  std::deque<std::pair<std::function<void()>, uint64_t>> q_;
  std::vector<std::function<void()>> finished_;
  uint64_t enqueued_ = 0, completed_ = 0;
  std::string error_;  // the first failure of a task, until a wait reports it
  std::thread worker_;
};

std::mutex g_queues_m;
std::map<std::pair<c10::DeviceIndex, c10::StreamId>, Queue*>& queues() {
  static auto* q = new std::map<std::pair<c10::DeviceIndex, c10::StreamId>, Queue*>();
  return *q;
}

Queue* queue_of(c10::DeviceIndex device, c10::StreamId id) {
  std::lock_guard<std::mutex> g(g_queues_m);
  Queue*& q = queues()[{device, id}];
  if (q == nullptr) {
    q = new Queue();
  }
  return q;
}

std::vector<Queue*> all_queues(int device /* -1: every device */) {
  std::lock_guard<std::mutex> g(g_queues_m);
  std::vector<Queue*> out;
  for (auto& [key, q] : queues()) {
    if (device < 0 || key.first == device) {
      out.push_back(q);
    }
  }
  return out;
}

void synchronize_all(int device = -1) {
  for (Queue* q : all_queues(device)) {
    q->drain();
  }
}

// An event: the queue it was last recorded on and the task it waits for.
struct Event {
  Queue* queue = nullptr;
  uint64_t seq = 0;
  std::chrono::steady_clock::time_point when;
  bool timing = false;
};

// ---------------------------------------------------------------------------
// memory

void junk(void* p, size_t n) {
  if (p != nullptr && n != 0) {
    std::memset(p, kJunk, n);
  }
}

void free_device(void* p) { c10::free_cpu(p); }

struct DeviceAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    void* p = n ? c10::alloc_cpu(n) : nullptr;
    junk(p, n);
    return {p, p, &free_device, c10::Device(kType, current_device())};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_device; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

DeviceAllocator g_device_allocator;
REGISTER_ALLOCATOR(kType, &g_device_allocator)

// Pinned host memory: ordinary memory whose ranges are remembered, so that
// is_pinned() and the copies can tell it from pageable memory.
std::mutex g_pinned_m;
std::map<uintptr_t, size_t>& pinned_ranges() {
  static auto* m = new std::map<uintptr_t, size_t>();
  return *m;
}

bool is_pinned_ptr(const void* p) {
  if (p == nullptr) {
    return false;
  }
  auto a = reinterpret_cast<uintptr_t>(p);
  std::lock_guard<std::mutex> g(g_pinned_m);
  auto& m = pinned_ranges();
  auto it = m.upper_bound(a);
  if (it == m.begin()) {
    return false;
  }
  --it;
  return a < it->first + it->second;
}

void free_pinned(void* p) {
  if (p != nullptr) {
    std::lock_guard<std::mutex> g(g_pinned_m);
    pinned_ranges().erase(reinterpret_cast<uintptr_t>(p));
  }
  c10::free_cpu(p);
}

struct PinnedAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    void* p = n ? c10::alloc_cpu(n) : nullptr;
    junk(p, n);
    if (p != nullptr) {
      std::lock_guard<std::mutex> g(g_pinned_m);
      pinned_ranges()[reinterpret_cast<uintptr_t>(p)] = n;
    }
    return {p, p, &free_pinned, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_pinned; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

PinnedAllocator g_pinned_allocator;

// ---------------------------------------------------------------------------
// generators: CPU's, labelled with an npu device

struct Generator final : at::CPUGeneratorImpl {
  explicit Generator(c10::DeviceIndex i) {
    device_ = c10::Device(kType, i);
    key_set_ = c10::DispatchKeySet(c10::DispatchKey::PrivateUse1);
  }
};

const at::Generator& default_generator(c10::DeviceIndex i) {
  static auto* gens = [] {
    auto* v = new std::vector<at::Generator>();
    for (c10::DeviceIndex d = 0; d < kDevices; ++d) {
      v->push_back(at::make_generator<Generator>(d));
      v->back().set_current_seed(c10::default_rng_seed_val);
    }
    return v;
  }();
  if (i < 0) {
    i = current_device();
  }
  check_index(i);
  return (*gens)[i];
}

// ---------------------------------------------------------------------------
// hooks (torch.accelerator, pinned memory, generators)

struct Hooks final : at::PrivateUse1HooksInterface {
  void init() const override {}
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return g_enabled.load(); }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return g_enabled.load() ? kDevices : 0; }
  void setCurrentDevice(c10::DeviceIndex d) const override { set_device(d); }
  c10::DeviceIndex getCurrentDevice() const override { return current_device(); }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex d) const override {
    auto old = current_device();
    set_device(d);
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex d) const override {
    if (d < 0 || d >= kDevices) {
      return current_device();
    }
    return exchangeDevice(d);
  }
  bool isPinnedPtr(const void* data) const override { return is_pinned_ptr(data); }
  c10::Allocator* getPinnedMemoryAllocator() const override { return &g_pinned_allocator; }
  c10::Device getDeviceFromPtr(void*) const override { return c10::Device(kType, current_device()); }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex i) const override {
    return default_generator(i);
  }
  at::Generator getNewGenerator(c10::DeviceIndex i) const override {
    return at::make_generator<Generator>(i < 0 ? current_device() : i);
  }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    synchronize_all();
    auto* impl = storage.unsafeGetStorageImpl();
    TORCH_CHECK(impl->resizable(), "npu: this storage is not resizable");
    c10::DataPtr fresh = impl->allocator()->allocate(newsize);
    size_t keep = std::min(newsize, impl->nbytes());
    if (keep != 0) {
      std::memcpy(fresh.get(), impl->data(), keep);
    }
    impl->set_data_ptr_noswap(std::move(fresh));
    impl->set_nbytes(newsize);
  }
};

const bool g_hooks_registered = [] {
  at::RegisterPrivateUse1HooksInterface(new Hooks());
  return true;
}();

// ---------------------------------------------------------------------------
// device guard: devices, streams, events

struct GuardImpl final : c10::impl::DeviceGuardImplInterface {
  GuardImpl() = default;
  explicit GuardImpl(c10::DeviceType t) { TORCH_CHECK(t == kType); }
  c10::DeviceType type() const override { return kType; }
  c10::Device exchangeDevice(c10::Device d) const override {
    auto old = current_device();
    set_device(d.index());
    return c10::Device(kType, old);
  }
  c10::Device getDevice() const override { return c10::Device(kType, current_device()); }
  void setDevice(c10::Device d) const override { set_device(d.index()); }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.index() >= 0 && d.index() < kDevices) {
      t_device = d.index();
    }
  }
  c10::Stream getStream(c10::Device d) const override {
    auto i = d.index() < 0 ? current_device() : d.index();
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(kType, i), t_stream[i]);
  }
  c10::Stream getDefaultStream(c10::Device d) const override {
    auto i = d.index() < 0 ? current_device() : d.index();
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(kType, i), 0);
  }
  c10::Stream getNewStream(c10::Device d, int /*priority*/) const override {
    auto i = d.index() < 0 ? current_device() : d.index();
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(kType, i), g_next_stream++);
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool /*high_priority*/) const override {
    return getNewStream(d, 0);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    auto i = s.device_index();
    check_index(i);
    c10::Stream old(c10::Stream::UNSAFE, c10::Device(kType, i), t_stream[i]);
    t_stream[i] = s.id();
    return old;
  }
  c10::DeviceIndex deviceCount() const noexcept override { return kDevices; }

  void destroyEvent(void* event, c10::DeviceIndex) const noexcept override {
    delete static_cast<Event*>(event);
  }
  void record(void** event, const c10::Stream& stream, c10::DeviceIndex device_index,
              c10::EventFlag flag) const override {
    TORCH_CHECK(device_index == -1 || device_index == stream.device_index(), "npu: event device index ",
                static_cast<int>(device_index), " does not match the stream's ",
                static_cast<int>(stream.device_index()));
    auto* e = static_cast<Event*>(*event);
    if (e == nullptr) {
      e = new Event();
      e->timing = flag == c10::EventFlag::BACKEND_DEFAULT;
      *event = e;
    }
    e->queue = queue_of(stream.device_index(), stream.id());
    e->seq = e->queue->enqueued();
    e->when = std::chrono::steady_clock::now();
    ++g_events_recorded;
  }
  void block(void* event, const c10::Stream& stream) const override {
    auto* e = static_cast<Event*>(event);
    if (e == nullptr || e->queue == nullptr) {
      return;
    }
    Queue* waited = e->queue;
    uint64_t seq = e->seq;
    Queue* q = queue_of(stream.device_index(), stream.id());
    if (q != waited) {
      q->push([waited, seq] { waited->wait_on_worker(seq); });
    }
  }
  bool queryEvent(void* event) const override {
    auto* e = static_cast<Event*>(event);
    return e == nullptr || e->queue == nullptr || e->queue->reached(e->seq);
  }
  void synchronizeEvent(void* event) const override {
    auto* e = static_cast<Event*>(event);
    ++g_event_waits;
    if (e != nullptr && e->queue != nullptr) {
      e->queue->wait(e->seq);
    }
  }
  bool queryStream(const c10::Stream& stream) const override {
    Queue* q = queue_of(stream.device_index(), stream.id());
    return q->reached(q->enqueued());
  }
  void synchronizeStream(const c10::Stream& stream) const override {
    queue_of(stream.device_index(), stream.id())->drain();
  }
  void synchronizeDevice(c10::DeviceIndex device_index) const override {
    synchronize_all(device_index < 0 ? current_device() : device_index);
  }
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
  double elapsedTime(void* event1, void* event2, c10::DeviceIndex) const override {
    auto* a = static_cast<Event*>(event1);
    auto* b = static_cast<Event*>(event2);
    TORCH_CHECK(a && b && a->queue && b->queue, "npu: both events must be recorded");
    TORCH_CHECK(a->timing && b->timing, "npu: events were created without enable_timing");
    synchronizeEvent(event1);
    synchronizeEvent(event2);
    return std::chrono::duration<double, std::milli>(b->when - a->when).count();
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, GuardImpl);

// ---------------------------------------------------------------------------
// operators

at::Tensor as_host(const at::Tensor& t) {
  if (t.is_cpu()) {
    return t;
  }
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), t.options().device(at::kCPU));
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                               std::optional<bool> pin_memory,
                               std::optional<c10::MemoryFormat> memory_format) {
  const auto dev = c10::device_or_default(device);
  TORCH_CHECK(dev.is_privateuseone(), "npu: empty on ", dev);
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided, "npu: only strided tensors");
  TORCH_CHECK(!c10::pinned_memory_or_default(pin_memory), "npu: only CPU memory can be pinned");
  const c10::DeviceGuard guard(dev);
  return at::detail::empty_generic(size, &g_device_allocator, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<c10::ScalarType> dtype,
                         std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                         std::optional<bool> pin_memory) {
  const auto dev = c10::device_or_default(device);
  TORCH_CHECK(dev.is_privateuseone(), "npu: empty_strided on ", dev);
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided, "npu: only strided tensors");
  TORCH_CHECK(!c10::pinned_memory_or_default(pin_memory), "npu: only CPU memory can be pinned");
  const c10::DeviceGuard guard(dev);
  return at::detail::empty_strided_generic(size, stride, &g_device_allocator,
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

at::Tensor as_strided(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride,
                      std::optional<c10::SymInt> storage_offset) {
  return at::cpu::as_strided_symint(self, size, stride, std::move(storage_offset));
}

const at::Tensor& resize_(const at::Tensor& self, c10::SymIntArrayRef size,
                          std::optional<at::MemoryFormat> memory_format) {
  synchronize_all();  // the storage may be reallocated and its bytes copied
  return at::native::resize_(self, C10_AS_INTARRAYREF_SLOW(size), memory_format);
}

at::Tensor reshape_alias(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  return at::native::_reshape_alias(self, C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride));
}

at::Tensor view(const at::Tensor& self, c10::SymIntArrayRef size) {
  return at::native::view(self, C10_AS_INTARRAYREF_SLOW(size));
}

at::Tensor& set_source_tensor(at::Tensor& self, const at::Tensor& source) {
  return at::native::set_tensor_(self, source);
}

at::Tensor& set_source_storage(at::Tensor& self, at::Storage source) { return at::native::set_(self, source); }

at::Tensor& set_source_storage_offset(at::Tensor& self, at::Storage source, int64_t offset, c10::IntArrayRef size,
                                      c10::IntArrayRef stride) {
  return at::cpu::set_(self, std::move(source), offset, size, stride);
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  TORCH_CHECK(self.defined() && dst.defined(), "npu: copy of an undefined tensor");
  const bool to_host = dst.is_cpu() && self.is_privateuseone();
  const bool from_host = self.is_cpu() && dst.is_privateuseone();
  const at::Tensor& host = to_host ? dst : self;
  if (non_blocking && (to_host || from_host) && is_pinned_ptr(host.storage().data())) {
    // Asynchronous, on the current stream of the device side, as CUDA does it.
    const at::Tensor& dev = to_host ? self : dst;
    const c10::DeviceIndex d = dev.device().index();
    Queue* q = queue_of(d, t_stream[d]);
    at::Tensor dst_view = as_host(dst);
    at::Tensor src_view = as_host(self).expand_as(dst_view);  // shape errors raise here, not later
    int64_t delay = g_delay_us.load();
    // The tensors are held until the copy is done, then dropped by a caller's thread.
    q->push([src_view, dst_view, self_ref = self, dst_ref = dst, delay]() mutable {
      if (delay > 0) {
        std::this_thread::sleep_for(std::chrono::microseconds(delay));
      }
      at::native::copy_(dst_view, src_view, false);
    });
    ++g_async_copies;
    return dst;
  }
  synchronize_all();
  at::Tensor dst_view = as_host(dst);
  at::native::copy_(dst_view, as_host(self), false);
  ++g_sync_copies;
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  synchronize_all();
  at::native::resize_(dst, self.sizes(), std::nullopt);
  return copy_from(self, dst, false);
}

at::Scalar local_scalar_dense(const at::Tensor& self) {
  synchronize_all();
  return at::native::_local_scalar_dense_cpu(self);
}

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  synchronize_all();  // stream order: queued copies land before any kernel runs
  at::native::cpu_fallback(op, stack);
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("as_strided", as_strided);
  m.impl("resize_", resize_);
  m.impl("_reshape_alias", reshape_alias);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("_local_scalar_dense", local_scalar_dense);
  m.impl("set_.source_Tensor", set_source_tensor);
  m.impl("set_.source_Storage", set_source_storage);
  m.impl("set_.source_Storage_storage_offset", set_source_storage_offset);
  m.impl("view", view);
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

}  // namespace npu

// ---------------------------------------------------------------------------
// Python: what tests/npu/__init__.py builds torch.npu from

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("set_enabled", [](bool on) { npu::g_enabled = on; });
  m.def("enabled", [] { return npu::g_enabled.load(); });
  m.def("set_delay_us", [](int64_t us) { npu::g_delay_us = us < 0 ? 0 : us; });
  m.def("delay_us", [] { return npu::g_delay_us.load(); });
  m.def("device_count", [] { return static_cast<int>(npu::kDevices); });
  m.def("current_device", [] { return static_cast<int>(npu::current_device()); });
  m.def("set_device", [](int i) { npu::set_device(static_cast<c10::DeviceIndex>(i)); });
  m.def("synchronize", [](int device) {
    py::gil_scoped_release nogil;
    npu::synchronize_all(device);
  }, py::arg("device") = -1);
  m.def("is_pinned_ptr", [](uintptr_t p) { return npu::is_pinned_ptr(reinterpret_cast<void*>(p)); });
  m.def("default_generator", [](int i) {
    return py::reinterpret_steal<py::object>(
        THPGenerator_initDefaultGenerator(npu::default_generator(static_cast<c10::DeviceIndex>(i))));
  });
  m.def("stats", [] {
    py::dict d;
    d["async_copies"] = npu::g_async_copies.load();
    d["sync_copies"] = npu::g_sync_copies.load();
    d["events_recorded"] = npu::g_events_recorded.load();
    d["event_waits"] = npu::g_event_waits.load();
    return d;
  });
}
