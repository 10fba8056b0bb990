// cuda_emu.h: run CUDA kernels on the CPU, one OS thread per CUDA thread (C++20, g++).
//
// A launch spawns blockDim threads that walk the grid's blocks one at a time, together:
// - threadIdx/blockIdx are thread_local, blockDim/gridDim global;
// - __shared__ is `static`: one copy per kernel instantiation, which is per block because blocks run
//   one after another (a block barrier separates them);
// - __syncthreads is a std::barrier over the block; __syncwarp a std::barrier per warp;
// - __shfl_xor_sync writes the lane's value to a per-warp exchange buffer, waits on the warp barrier,
//   reads its partner's slot, and waits again so no lane overwrites a value still being read;
// - a watchdog returns an error when a launch does not finish in time (a deadlock, e.g. a shuffle or
//   barrier that not every thread reaches); the stuck threads are detached and the library refuses
//   further launches.
// Limits: no tensor cores, TMA or inline PTX (the kernels use none under STREAMATTN_EMULATION);
// libm exp2f/log2f instead of the GPU's approximations.
#pragma once
#define STREAMATTN_EMULATION 1

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

struct dim3 { unsigned x = 1, y = 1, z = 1; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }

namespace emu {
inline thread_local dim3 tls_thread, tls_block;
inline dim3 g_block_dim, g_grid_dim;

struct Block {
    explicit Block(unsigned n) : block(n) {
        for (unsigned w = 0; w < n / 32; ++w) warps.push_back(std::make_unique<std::barrier<>>(32));
        exchange.resize(n);
    }
    std::barrier<> block;
    std::vector<std::unique_ptr<std::barrier<>>> warps;
    std::vector<std::uint64_t> exchange;  // one 8-byte slot per thread, for shuffles
};
inline Block* g_ctx = nullptr;

inline unsigned flat_tid() {
    return tls_thread.x + g_block_dim.x * (tls_thread.y + g_block_dim.y * tls_thread.z);
}
}  // namespace emu

#define threadIdx (emu::tls_thread)
#define blockIdx (emu::tls_block)
#define blockDim (emu::g_block_dim)
#define gridDim (emu::g_grid_dim)
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __shared__ static
#define __launch_bounds__(...)

using std::max;
using std::min;

inline void __syncthreads() { emu::g_ctx->block.arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::g_ctx->warps[emu::flat_tid() / 32]->arrive_and_wait(); }

template <typename T> T __shfl_xor_sync(unsigned, T value, int lane_mask, int = 32) {
    static_assert(sizeof(T) <= 8, "shuffle of at most 8 bytes");
    const unsigned tid = emu::flat_tid();
    auto& bar = *emu::g_ctx->warps[tid / 32];
    std::memcpy(&emu::g_ctx->exchange[tid], &value, sizeof(T));
    bar.arrive_and_wait();
    T got;
    std::memcpy(&got, &emu::g_ctx->exchange[(tid & ~31u) | ((tid & 31u) ^ unsigned(lane_mask))], sizeof(T));
    bar.arrive_and_wait();
    return got;
}

inline float __uint_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned i; std::memcpy(&i, &f, 4); return i; }
using std::isfinite;
// atomicMin on a 32-bit int, as the device's: returns the old value (kernels/append.cu's finite flag).
inline int atomicMin(int* address, int value) {
    std::atomic_ref<int> a(*address);
    int old = a.load();
    while (value < old && !a.compare_exchange_weak(old, value)) {}
    return old;
}
inline float __fdividef(float a, float b) { return a / b; }  // the device's is within 2 ulp of this

// IEEE binary16 bits -> float (what cvt.f32.f16 does on the GPU), exact for every input.
inline float sa_half_to_float(unsigned short h) {
    const unsigned sign = unsigned(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    unsigned bits;
    if (exp == 0x1f) bits = sign | 0x7f800000u | (mant << 13);  // inf / nan
    else if (exp != 0) bits = sign | ((exp + 112u) << 23) | (mant << 13);
    else if (mant == 0) bits = sign;
    else return (h & 0x8000u ? -1.0f : 1.0f) * std::ldexp(float(mant), -24);  // subnormal
    return __uint_as_float(bits);
}

namespace emu {
using Entry = std::function<void(void**)>;

template <typename... A, std::size_t... I> void call(void (*f)(A...), void** args, std::index_sequence<I...>) {
    f(*static_cast<std::remove_reference_t<A>*>(args[I])...);
}
// Wrap a kernel so it takes its arguments as cuLaunchKernel does: an array of pointers to each value.
template <typename... A> Entry entry(void (*f)(A...)) {
    return [f](void** args) { call(f, args, std::index_sequence_for<A...>{}); };
}

inline std::atomic<bool> g_poisoned{false};

inline int launch(const Entry& kernel, dim3 grid, dim3 block, void** args, double timeout_s, char* err, int errlen) {
    if (g_poisoned) { std::snprintf(err, errlen, "an earlier launch deadlocked"); return 2; }
    const unsigned n = block.x * block.y * block.z;
    if (n == 0 || n % 32 || n > 1024) { std::snprintf(err, errlen, "block of %u threads: need a multiple of 32, <= 1024", n); return 3; }
    auto ctx = std::make_shared<Block>(n);
    g_ctx = ctx.get();
    g_block_dim = block;
    g_grid_dim = grid;
    auto done = std::make_shared<std::atomic<unsigned>>(0);
    auto mtx = std::make_shared<std::mutex>();
    auto cv = std::make_shared<std::condition_variable>();
    std::vector<std::thread> threads;
    for (unsigned t = 0; t < n; ++t) {
        threads.emplace_back([=, &kernel] {
            tls_thread = dim3{t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
            for (unsigned bz = 0; bz < grid.z; ++bz)
                for (unsigned by = 0; by < grid.y; ++by)
                    for (unsigned bx = 0; bx < grid.x; ++bx) {
                        tls_block = dim3{bx, by, bz};
                        kernel(args);
                        ctx->block.arrive_and_wait();  // the next block may reuse shared memory
                    }
            std::lock_guard<std::mutex> lock(*mtx);
            if (++*done == n) cv->notify_all();
        });
    }
    std::unique_lock<std::mutex> lock(*mtx);
    const bool finished = cv->wait_for(lock, std::chrono::duration<double>(timeout_s), [&] { return *done == n; });
    lock.unlock();
    if (!finished) {
        g_poisoned = true;
        for (auto& t : threads) t.detach();
        std::snprintf(err, errlen, "launch did not finish in %.1f s: deadlock (%u of %u threads done)", timeout_s,
                      done->load(), n);
        return 1;
    }
    for (auto& t : threads) t.join();
    return 0;
}
}  // namespace emu

// The generated translation unit defines this table: readable name -> wrapped kernel.
extern const std::map<std::string, emu::Entry>& emu_table();

extern "C" int emu_launch(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                          unsigned bz, void** args, double timeout_s, char* err, int errlen) {
    const auto& table = emu_table();
    const auto it = table.find(name);
    if (it == table.end()) { std::snprintf(err, errlen, "no kernel named %s in this build", name); return 4; }
    return emu::launch(it->second, dim3{gx, gy, gz}, dim3{bx, by, bz}, args, timeout_s, err, errlen);
}
