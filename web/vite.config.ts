/// <reference types="vitest/config" />
import { fileURLToPath } from "node:url";
import react from "@vitejs/plugin-react";
import { defineConfig } from "vite";

// The build goes into the Python package, which serves it at "/" (python/colibri/api/web.py).
// COLIBRI_WEB_OUT_DIR lets the up-to-date test build elsewhere and compare.
const outDir =
  process.env.COLIBRI_WEB_OUT_DIR ??
  fileURLToPath(new URL("../python/colibri/_web", import.meta.url));

export default defineConfig({
  plugins: [react()],
  base: "./",
  build: {
    outDir,
    emptyOutDir: true,
    target: "es2022",
    sourcemap: false,
    chunkSizeWarningLimit: 1024,
  },
  server: { port: 5173, strictPort: true },
  test: { environment: "node", include: ["src/**/*.test.ts"] },
});
