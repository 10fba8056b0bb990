// One timed llama.cpp run for benchmarks/peer_llamacpp.py, through node-llama-cpp's prebuilt CPU binaries.
//   node peer_llamacpp.mjs   (copied into .peer/llamacpp/ by the Python script, where node-llama-cpp resolves)
//   node peer_llamacpp.mjs '{"model": PATH, "prompt_file": PATH, "tokens": N, "threads": T}'
// Prefill the prompt, then greedy-decode exactly N tokens (end-of-generation tokens do not stop it, as
// llama.cpp's --ignore-eos). Prints one JSON line: prompt_tokens, prefill_s (prompt in, first token out),
// decode_s (first token to last: N - 1 steps), the token ids, the llama.cpp release.
import {readFileSync} from "node:fs";
import {getLlama} from "node-llama-cpp";

const args = JSON.parse(process.argv[2]);
const llama = await getLlama({gpu: false, build: "never", logLevel: "error", maxThreads: args.threads});
const model = await llama.loadModel({modelPath: args.model, gpuLayers: 0});
const text = readFileSync(args.prompt_file, "utf8");
const tokens = model.tokenize(text);
const context = await model.createContext({contextSize: tokens.length + args.tokens + 16, batchSize: 512,
                                            threads: {ideal: args.threads, min: args.threads}});
const sequence = context.getSequence();
const out = [];
const t0 = performance.now();
let t1 = t0;
for await (const token of sequence.evaluate(tokens, {temperature: 0, yieldEogToken: true})) {
    if (out.length === 0) t1 = performance.now();
    out.push(token);
    if (out.length === args.tokens) break;
}
const t2 = performance.now();
console.log(JSON.stringify({prompt_tokens: tokens.length, prefill_s: (t1 - t0) / 1e3, decode_s: (t2 - t1) / 1e3,
                            decode_steps: out.length - 1, token_ids: out, threads: context.currentThreads,
                            llama_cpp: llama.llamaCppRelease}));
await context.dispose();
await model.dispose();
await llama.dispose();
