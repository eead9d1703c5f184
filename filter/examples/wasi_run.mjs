// Runs a wasm32-wasip1 example of this crate in Node's V8 (see examples/body_path.rs):
//   node --no-liftoff filter/examples/wasi_run.mjs <example.wasm> [args…]
// The proxy-wasm host functions the crate imports are stubbed (they return 0): only code that
// does not call the host is meaningful here.
import { readFile } from 'node:fs/promises';
import { WASI } from 'node:wasi';
import { argv } from 'node:process';

const wasi = new WASI({ version: 'preview1', args: ['example', ...argv.slice(3)], env: {} });
const module = await WebAssembly.compile(await readFile(argv[2]));
const imports = wasi.getImportObject();
for (const i of WebAssembly.Module.imports(module)) {
  if (i.module !== 'wasi_snapshot_preview1') {
    imports[i.module] ??= {};
    imports[i.module][i.name] = () => 0;
  }
}
const instance = await WebAssembly.instantiate(module, imports);
// The cdylib crate also exports `_initialize`, which WASI.start refuses next to `_start`.
wasi.start({ exports: { memory: instance.exports.memory, _start: instance.exports._start } });
