// tsan_main.cpp: one decode launch and one prefill launch of the emulated kernels, as a program, for a
// ThreadSanitizer build (-fsanitize=thread). A missing __syncthreads/__syncwarp shows up as a data race
// on the `static` (= __shared__) arrays. Compiled together with the generated emu_unit.cpp.
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

extern "C" int emu_launch(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                          unsigned bz, void** args, double timeout_s, char* err, int errlen);

int main() {
    const int batch = 2, q_heads = 4, kv_heads = 2, hd = 64, slots = 12, window = 6, sinks = 2, T = 4;
    std::mt19937 gen(1);
    std::uniform_int_distribution<int> bits(0x3000, 0x3bff);  // small positive float16 / bfloat16 values
    std::normal_distribution<float> normal;
    std::vector<std::uint16_t> k(batch * kv_heads * slots * hd), v(k.size());
    for (auto& x : k) x = std::uint16_t(bits(gen));
    for (auto& x : v) x = std::uint16_t(bits(gen));
    std::vector<float> q(batch * q_heads * T * hd);
    for (auto& x : q) x = normal(gen);
    std::vector<int> lengths = {30, 9}, counts = {4, 3}, ones = {1, 1};
    std::vector<float> out(batch * q_heads * T * hd), lse(batch * q_heads * T);
    int qh = q_heads, kvh = kv_heads, sl = slots, win = window, snk = sinks, rows = T, splits = 2;
    float scale = 0.18f, softcap = 0.0f;  // softcap: read by the _softcap variants only
    char err[512];

    // decode: q is the first T rows' worth of memory, read as [batch, q_heads, hd]; 2 splits; q_sink = q
    std::vector<float> part_out(batch * q_heads * splits * hd), part_lse(batch * q_heads * splits);
    const void *pq = q.data(), *pk = k.data(), *pv = v.data(), *pl = lengths.data(), *p1 = ones.data();
    void *po = part_out.data(), *pls = part_lse.data();
    void* dargs[] = {&pq, &pq, &pk, &pv, &pl, &p1, &po, &pls, &qh, &kvh, &sl, &win, &snk, &splits, &scale, &softcap};
    if (emu_launch("decode_f16_hd64", splits, kv_heads, batch, 128, 1, 1, dargs, 120.0, err, sizeof err)) {
        std::fprintf(stderr, "decode: %s\n", err);
        return 1;
    }
    // prefill: a chunk of T rows, bf16 storage
    const void* pc = counts.data();
    void *pout = out.data(), *plse = lse.data();
    void* pargs[] = {&pq, &pq, &pk, &pv, &pl, &pc, &pout, &plse, &qh, &kvh, &sl, &rows, &win, &snk, &scale, &softcap};
    if (emu_launch("prefill_bf16_hd64", 1, kv_heads, batch, 128, 1, 1, pargs, 120.0, err, sizeof err)) {
        std::fprintf(stderr, "prefill: %s\n", err);
        return 1;
    }
    std::printf("ok %g %g\n", double(part_out[0]), double(out[0]));
    return 0;
}
