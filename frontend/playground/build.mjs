// Builds the playground into dist/ (or the folder given as --outdir DIR): index.html, playground.js
// and playground.css, which sluice-common's playground.rs embeds with include_bytes! (the frontend and
// the router serve it). dist/ is committed, so that building them needs no Node.js;
// tests/e2e/test_playground_bundle.py checks it is up to date.
import { copyFile, mkdir, readdir, readFile, writeFile } from "node:fs/promises";
import path from "node:path";
import { fileURLToPath } from "node:url";
import * as esbuild from "esbuild";

const here = path.dirname(fileURLToPath(import.meta.url));
const flag = process.argv.indexOf("--outdir");
const outdir = flag === -1 ? path.join(here, "dist") : path.resolve(process.argv[flag + 1]);

/** Each bundled npm package's licence text, for the notice that ships beside the bundle. */
async function licences(metafile) {
  const packages = new Set();
  for (const input of Object.keys(metafile.inputs)) {
    const match = input.match(/node_modules\/((?:@[^/]+\/)?[^/]+)\//);
    if (match) packages.add(match[1]);
  }
  const texts = [];
  for (const name of [...packages].sort()) {
    const folder = path.join(here, "node_modules", name);
    const file = (await readdir(folder)).find((entry) => /^(licen[cs]e|copying)/i.test(entry));
    if (!file) throw new Error(`${name} is bundled but has no licence file`);
    const { version } = JSON.parse(await readFile(path.join(folder, "package.json"), "utf8"));
    texts.push(`${name} ${version}\n\n${(await readFile(path.join(folder, file), "utf8")).trim()}\n`);
  }
  return texts.join(`\n${"-".repeat(72)}\n\n`);
}

await mkdir(outdir, { recursive: true });
const result = await esbuild.build({
  entryPoints: { playground: path.join(here, "src", "main.js") },
  bundle: true,
  format: "esm",
  minify: true,
  target: ["chrome110", "firefox115", "safari16"],
  legalComments: "none",
  metafile: true,
  outdir,
  logLevel: "warning",
});
await writeFile(path.join(outdir, "licences.txt"), await licences(result.metafile));
await copyFile(path.join(here, "src", "index.html"), path.join(outdir, "index.html"));
