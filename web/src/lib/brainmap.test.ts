import { describe, expect, it } from "vitest";
import {
  CANVAS_MIN_CELLS,
  FLASH_MS,
  LABEL_WIDTH,
  MAX_CELL,
  MIN_CELL,
  cellRect,
  drawsOnCanvas,
  flashLevel,
  heatShare,
  hitTest,
  mapLayout,
  mix,
  moveCursor,
  parseColor,
  rgbText,
} from "./brainmap";

describe("when the map is drawn on a canvas", () => {
  it("switches above the threshold: the demo model stays DOM cells, a DeepSeek-sized model is a canvas", () => {
    expect(drawsOnCanvas(4, 8)).toBe(false);
    expect(drawsOnCanvas(32, 32)).toBe(false); // exactly the threshold
    expect(drawsOnCanvas(32, 33)).toBe(true);
    expect(drawsOnCanvas(1, CANVAS_MIN_CELLS)).toBe(false);
    expect(drawsOnCanvas(1, CANVAS_MIN_CELLS + 1)).toBe(true);
    expect(drawsOnCanvas(58, 256)).toBe(true);
    expect(drawsOnCanvas(92, 256)).toBe(true);
  });
});

describe("mapLayout", () => {
  it("fits square cells into the width, with a gap once they are big enough", () => {
    // 1280 px for 64 experts: (1280 - 36) / 64 = 19 px a cell pitch, clamped to 14 + 1 gap.
    const wide = mapLayout(1280, 23, 64);
    expect(wide).toEqual({ rows: 23, cols: 64, label: LABEL_WIDTH, cell: MAX_CELL, gap: 1, width: LABEL_WIDTH + 64 * 15, height: 23 * 15 });
    // 256 experts in 1280 px: pitch 4, no gap.
    const deepseek = mapLayout(1280, 58, 256);
    expect([deepseek.cell, deepseek.gap]).toEqual([4, 0]);
    expect(deepseek.width).toBeLessThanOrEqual(1280);
    // 256 experts at 360 px: cells never below MIN_CELL, the drawing is wider (it scrolls).
    const phone = mapLayout(328, 58, 256);
    expect([phone.cell, phone.gap]).toEqual([MIN_CELL, 0]);
    expect(phone.width).toBe(LABEL_WIDTH + 256 * MIN_CELL);
    // Any width: the drawing fits the room whenever the cells are above the minimum.
    for (let w = 40; w < 3000; w += 37) {
      for (const cols of [8, 64, 160, 256]) {
        const l = mapLayout(w, 10, cols);
        expect(l.cell).toBeGreaterThanOrEqual(MIN_CELL);
        expect(l.cell).toBeLessThanOrEqual(MAX_CELL);
        if (l.cell > MIN_CELL) expect(l.width).toBeLessThanOrEqual(w);
      }
    }
  });
});

describe("hitTest", () => {
  it("finds the cell under every point of every cell, and nothing in labels, gaps or outside", () => {
    for (const l of [mapLayout(1280, 23, 64), mapLayout(1280, 58, 256), mapLayout(328, 6, 256)]) {
      const step = l.cell + l.gap;
      for (const [row, col] of [
        [0, 0],
        [0, l.cols - 1],
        [l.rows - 1, 0],
        [l.rows - 1, l.cols - 1],
        [Math.floor(l.rows / 2), Math.floor(l.cols / 3)],
      ] as const) {
        const r = cellRect(l, row, col);
        expect([r.x, r.y, r.size]).toEqual([l.label + col * step, row * step, l.cell]);
        for (const dx of [0, l.cell / 2, l.cell - 0.01]) {
          for (const dy of [0, l.cell / 2, l.cell - 0.01]) {
            expect(hitTest(l, r.x + dx, r.y + dy)).toEqual({ row, col });
          }
        }
        if (l.gap > 0) {
          expect(hitTest(l, r.x + l.cell + 0.5, r.y + 1)).toBeNull();
          expect(hitTest(l, r.x + 1, r.y + l.cell + 0.5)).toBeNull();
        }
      }
      expect(hitTest(l, l.label - 1, 2)).toBeNull();
      expect(hitTest(l, l.label + 1, -1)).toBeNull();
      expect(hitTest(l, l.width + 1, 2)).toBeNull();
      expect(hitTest(l, l.label + 1, l.height + 1)).toBeNull();
    }
  });
});

describe("moveCursor", () => {
  it("moves by keys and stays on the map", () => {
    const l = mapLayout(1280, 5, 8);
    expect(moveCursor(l, 0, 0, "ArrowRight")).toEqual({ row: 0, col: 1 });
    expect(moveCursor(l, 0, 0, "ArrowLeft")).toEqual({ row: 0, col: 0 });
    expect(moveCursor(l, 4, 7, "ArrowDown")).toEqual({ row: 4, col: 7 });
    expect(moveCursor(l, 2, 3, "ArrowUp")).toEqual({ row: 1, col: 3 });
    expect(moveCursor(l, 2, 3, "End")).toEqual({ row: 2, col: 7 });
    expect(moveCursor(l, 2, 3, "Home")).toEqual({ row: 2, col: 0 });
    expect(moveCursor(l, 2, 3, "PageDown")).toEqual({ row: 4, col: 3 });
    expect(moveCursor(l, 2, 3, "PageUp")).toEqual({ row: 0, col: 3 });
    expect(moveCursor(l, 2, 3, "a")).toBeNull();
  });
});

describe("colours", () => {
  it("parses the stylesheet's colours and mixes them as color-mix does", () => {
    expect(parseColor("#c77700")).toEqual([199, 119, 0]);
    expect(parseColor(" #fff ")).toEqual([255, 255, 255]);
    expect(parseColor("rgb(11, 107, 203)")).toEqual([11, 107, 203]);
    expect(parseColor("rgba(1, 2, 3, 0.5)")).toEqual([1, 2, 3]);
    expect(parseColor("rgb(1 2 3)")).toEqual([1, 2, 3]);
    expect(parseColor("blue")).toBeNull();
    expect(parseColor("")).toBeNull();
    expect(mix([200, 100, 0], [0, 0, 100], 1)).toEqual([200, 100, 0]);
    expect(mix([200, 100, 0], [0, 0, 100], 0)).toEqual([0, 0, 100]);
    expect(mix([200, 100, 0], [0, 0, 100], 0.25)).toEqual([50, 25, 75]);
    expect(mix([200, 100, 0], [0, 0, 100], 7)).toEqual([200, 100, 0]);
    expect(rgbText([1, 2, 3])).toBe("rgb(1, 2, 3)");
  });

  it("ramps brightness with heat like the DOM cells, and fades the flash out", () => {
    expect(heatShare(0)).toBeCloseTo(0.08);
    expect(heatShare(1)).toBe(1);
    expect(heatShare(0.5)).toBeCloseTo(0.54);
    expect(heatShare(-1)).toBeCloseTo(0.08);
    expect(flashLevel(0)).toBe(1);
    expect(flashLevel(FLASH_MS / 2)).toBeCloseTo(0.25);
    expect(flashLevel(FLASH_MS)).toBe(0);
    expect(flashLevel(-5)).toBe(0);
    let last = 2;
    for (let t = 0; t < FLASH_MS; t += 50) {
      const v = flashLevel(t);
      expect(v).toBeLessThan(last);
      last = v;
    }
  });
});
