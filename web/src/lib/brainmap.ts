/** The Brain page's canvas map: where each cell is drawn, which cell a point falls on, and the
 * colours (pure maths, tested by vitest; the page draws with them). A real DeepSeek/GLM model
 * has ~60-90 MoE layers x 256 experts: one DOM element per cell is too slow there, one canvas
 * is not. */

/** Above this many cells the map is drawn on a canvas instead of one element per cell. */
export const CANVAS_MIN_CELLS = 1024;

export function drawsOnCanvas(layers: number, experts: number): boolean {
  return layers * experts > CANVAS_MIN_CELLS;
}

export interface MapLayout {
  rows: number;
  cols: number;
  /** Width of the row labels ("L12") on the left, in CSS pixels. */
  label: number;
  /** A cell's side and the gap after it, in CSS pixels. */
  cell: number;
  gap: number;
  /** The whole drawing, in CSS pixels (wider than the room given when the cells would be
   * smaller than `MIN_CELL`: the map then scrolls sideways in its own box). */
  width: number;
  height: number;
}

export const LABEL_WIDTH = 36;
export const MIN_CELL = 3;
export const MAX_CELL = 14;

/** The layout of `rows` x `cols` cells in `width` CSS pixels: square cells as large as fit
 * (between MIN_CELL and MAX_CELL), a 1 px gap once cells are 6 px or more. */
export function mapLayout(width: number, rows: number, cols: number): MapLayout {
  const room = Math.max(0, width - LABEL_WIDTH);
  const pitch = cols > 0 ? Math.floor(room / cols) : MAX_CELL;
  const gap = pitch >= 7 ? 1 : 0;
  const cell = Math.max(MIN_CELL, Math.min(MAX_CELL, pitch - gap));
  const step = cell + gap;
  return { rows, cols, label: LABEL_WIDTH, cell, gap, width: LABEL_WIDTH + cols * step, height: rows * step };
}

export interface CellRect {
  x: number;
  y: number;
  size: number;
}

export function cellRect(l: MapLayout, row: number, col: number): CellRect {
  const step = l.cell + l.gap;
  return { x: l.label + col * step, y: row * step, size: l.cell };
}

/** The cell under the point (x, y) in CSS pixels from the drawing's top left, or null (the
 * labels, a gap, outside). */
export function hitTest(l: MapLayout, x: number, y: number): { row: number; col: number } | null {
  const step = l.cell + l.gap;
  const cx = x - l.label;
  if (cx < 0 || y < 0) return null;
  const col = Math.floor(cx / step);
  const row = Math.floor(y / step);
  if (col >= l.cols || row >= l.rows) return null;
  if (cx - col * step >= l.cell || y - row * step >= l.cell) return null;
  return { row, col };
}

/** The cell a key moves to from (row, col): arrows by one, Home/End to the row's ends,
 * PageUp/PageDown by ten rows; null for other keys. Stays inside the map. */
export function moveCursor(l: MapLayout, row: number, col: number, key: string): { row: number; col: number } | null {
  const clamp = (v: number, n: number) => Math.max(0, Math.min(n - 1, v));
  const moves: Record<string, [number, number]> = {
    ArrowUp: [-1, 0],
    ArrowDown: [1, 0],
    ArrowLeft: [0, -1],
    ArrowRight: [0, 1],
    PageUp: [-10, 0],
    PageDown: [10, 0],
  };
  if (key === "Home") return { row, col: 0 };
  if (key === "End") return { row, col: Math.max(0, l.cols - 1) };
  const m = moves[key];
  if (!m) return null;
  return { row: clamp(row + m[0], l.rows), col: clamp(col + m[1], l.cols) };
}

export type Rgb = [number, number, number];

/** A CSS colour as written in the stylesheet's custom properties: #rgb or #rrggbb, or
 * rgb()/rgba() as getComputedStyle reports colours; null for anything else. */
export function parseColor(text: string): Rgb | null {
  const t = text.trim();
  let m = /^#([0-9a-f]{3})$/i.exec(t);
  if (m) {
    const h = m[1] ?? "";
    return [0, 1, 2].map((i) => parseInt(h.charAt(i).repeat(2), 16)) as Rgb;
  }
  m = /^#([0-9a-f]{6})$/i.exec(t);
  if (m) {
    const h = m[1] ?? "";
    return [0, 2, 4].map((i) => parseInt(h.slice(i, i + 2), 16)) as Rgb;
  }
  m = /^rgba?\(\s*([\d.]+)[\s,]+([\d.]+)[\s,]+([\d.]+)/i.exec(t);
  if (m) return [Number(m[1]), Number(m[2]), Number(m[3])];
  return null;
}

/** `a` mixed into `b` by `t` (0: b, 1: a), as CSS color-mix(in srgb, a t%, b) does. */
export function mix(a: Rgb, b: Rgb, t: number): Rgb {
  const k = Math.max(0, Math.min(1, t));
  return [0, 1, 2].map((i) => Math.round((a[i] ?? 0) * k + (b[i] ?? 0) * (1 - k))) as Rgb;
}

export function rgbText(c: Rgb): string {
  return `rgb(${c[0]}, ${c[1]}, ${c[2]})`;
}

/** How much of a cell's tier colour shows at heat h (0..1): the same ramp as the DOM cells'
 * (8% for a never-chosen expert up to 100% for the hottest). */
export function heatShare(h: number): number {
  return 0.08 + 0.92 * Math.max(0, Math.min(1, h));
}

/** How strongly a last-turn cell is flashed white `ms` after the flash began (1 down to 0 over
 * `FLASH_MS`, easing out). */
export const FLASH_MS = 1200;
export function flashLevel(ms: number): number {
  if (ms < 0 || ms >= FLASH_MS) return 0;
  const t = ms / FLASH_MS;
  return (1 - t) * (1 - t);
}
