import { useEffect, useId, useMemo, useRef, useState, type CSSProperties, type KeyboardEvent, type MouseEvent } from "react";
import {
  errorText,
  expertCells,
  fetchExperts,
  tierCounts,
  type Connection,
  type ExpertCell,
  type ExpertMap,
  type Tier,
} from "../lib/api";
import {
  FLASH_MS,
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
  type MapLayout,
  type Rgb,
} from "../lib/brainmap";
import { usePoll } from "../lib/poll";

export const TIER_NAMES: Record<Tier, string> = {
  pinned: "pinned",
  cached: "RAM cache",
  resident: "RAM (resident)",
  disk: "disk",
  unknown: "not reported",
};

const TIER_HELP: Record<Tier, string> = {
  pinned: "the hottest experts, held in RAM for the whole run",
  cached: "in the expert cache now",
  resident: "every expert read into RAM at load (no expert cache)",
  disk: "read from the experts file on its next use",
  unknown: "the server does not report placement",
};

function cellLabel(c: ExpertCell): string {
  return `layer ${c.layer}, expert ${c.expert}: ${TIER_NAMES[c.tier]}, ${c.count} selections${c.routed ? ", routed in the last turn" : ""}`;
}

export function Brain({ conn }: { conn: Connection }) {
  const [map, setMap] = useState<ExpertMap | null>(null);
  const [error, setError] = useState<string | null>(null);
  const [flash, setFlash] = useState(0);
  const lastTurns = useRef<number | null>(null);

  usePoll(
    1500,
    (signal) => fetchExperts(conn, signal),
    (m) => {
      // A new turn since the last poll: its experts flash (a new key restarts the animation).
      if (lastTurns.current !== null && m.turns !== lastTurns.current) setFlash((f) => f + 1);
      lastTurns.current = m.turns;
      setMap(m);
      setError(null);
    },
    (e) => setError(errorText(e)),
    [conn],
  );

  const cells = useMemo(() => (map ? expertCells(map) : []), [map]);
  const canvas = map !== null && drawsOnCanvas(map.layers.length, map.experts);
  return (
    <section className="system" aria-label="Brain">
      <h1>Brain: expert routing</h1>
      {error !== null && (
        <div className="error" role="alert">
          {error}
        </div>
      )}
      {map === null ? (
        error === null && <p>loading…</p>
      ) : map.layers.length === 0 ? (
        <p className="muted">This model has no routed experts.</p>
      ) : (
        <div className="card">
          <p className="muted small">
            One cell per expert: a row per MoE layer, a column per expert. Colour: where the expert lives now; brightness: how often the
            router chose it (log scale); a ring: routed to in the last turn ({map.turns} turns so far), flashing when a turn ends.
          </p>
          <ul className="brain-legend" data-testid="brain-legend" aria-label="Where the experts live">
            {tierCounts(cells).map(([tier, n]) => (
              <li key={tier} data-tier={tier} title={TIER_HELP[tier]}>
                <span className={`swatch tier-${tier}`} aria-hidden="true" />
                {TIER_NAMES[tier]}: <span className="num">{n}</span>
              </li>
            ))}
          </ul>
          {canvas ? <CanvasMap map={map} cells={cells} flash={flash} /> : <GridMap map={map} cells={cells} flash={flash} />}
          <MapTable map={map} cells={cells} byLayer={canvas} />
        </div>
      )}
    </section>
  );
}

/** One element per cell: small maps (the demo model's 4 x 8). */
function GridMap({ map, cells, flash }: { map: ExpertMap; cells: ExpertCell[]; flash: number }) {
  return (
    <div
      className="brain"
      data-testid="brain-grid"
      style={{ gridTemplateColumns: `auto repeat(${map.experts}, minmax(0, 1fr))` }}
      aria-hidden="true"
    >
      {map.layers.map((l) => [
        <span key={`l${l.layer}`} className="brain-row">
          L{l.layer}
        </span>,
        ...cells
          .filter((c) => c.layer === l.layer)
          .map((c) => (
            <span
              key={`${c.layer}-${c.expert}-${c.routed ? flash : "x"}`}
              className={`cell tier-${c.tier}${c.routed ? " hit" : ""}${c.routed && flash > 0 ? " flash" : ""}`}
              style={{ "--heat": `${(100 * heatShare(c.heat)).toFixed(1)}%` } as CSSProperties}
              title={cellLabel(c)}
              data-layer={c.layer}
              data-expert={c.expert}
              data-tier={c.tier}
            />
          )),
      ])}
    </div>
  );
}

interface Palette {
  tiers: Record<Tier, Rgb>;
  empty: Rgb;
  ring: Rgb;
  label: Rgb;
  flash: Rgb;
}

/** The theme's colours, read from the stylesheet's custom properties. */
function readPalette(el: Element): Palette {
  const style = getComputedStyle(el);
  const get = (name: string, fallback: Rgb): Rgb => parseColor(style.getPropertyValue(name)) ?? fallback;
  return {
    tiers: {
      pinned: get("--tier-pinned", [199, 119, 0]),
      cached: get("--tier-cached", [11, 107, 203]),
      resident: get("--tier-resident", [11, 107, 203]),
      disk: get("--tier-disk", [107, 122, 144]),
      unknown: get("--accent", [11, 107, 203]),
    },
    empty: get("--code-bg", [240, 241, 243]),
    ring: get("--text", [29, 31, 33]),
    label: get("--muted", [98, 102, 107]),
    flash: [255, 255, 255],
  };
}

/** The theme in use changes (the top bar's button, or the system's scheme). */
function useThemeChanges(onChange: () => void): void {
  const cb = useRef(onChange);
  cb.current = onChange;
  useEffect(() => {
    const fire = () => cb.current();
    const observer = new MutationObserver(fire);
    observer.observe(document.documentElement, { attributes: true, attributeFilter: ["data-theme"] });
    const media = window.matchMedia("(prefers-color-scheme: dark)");
    media.addEventListener("change", fire);
    return () => {
      observer.disconnect();
      media.removeEventListener("change", fire);
    };
  }, []);
}

/** Big maps (a real model's ~60-90 layers x 256 experts) on one canvas: a tooltip by
 * hit-testing the pointer, the arrow keys move a cursor cell with the same tooltip. */
function CanvasMap({ map, cells, flash }: { map: ExpertMap; cells: ExpertCell[]; flash: number }) {
  const box = useRef<HTMLDivElement>(null);
  const ref = useRef<HTMLCanvasElement>(null);
  const [width, setWidth] = useState(0);
  const [themeTick, setThemeTick] = useState(0);
  const [hover, setHover] = useState<{ row: number; col: number; x: number; y: number } | null>(null);
  const [cursor, setCursor] = useState<{ row: number; col: number } | null>(null);
  const flashStart = useRef<number | null>(null);
  useThemeChanges(() => setThemeTick((t) => t + 1));

  useEffect(() => {
    const el = box.current;
    if (!el) return;
    const observer = new ResizeObserver(() => setWidth(el.clientWidth));
    observer.observe(el);
    setWidth(el.clientWidth);
    return () => observer.disconnect();
  }, []);

  const layout: MapLayout = useMemo(() => mapLayout(width, map.layers.length, map.experts), [width, map.layers.length, map.experts]);

  useEffect(() => {
    if (flash > 0) flashStart.current = performance.now();
  }, [flash]);

  useEffect(() => {
    const canvas = ref.current;
    if (!canvas || width === 0) return;
    const ctx = canvas.getContext("2d");
    if (!ctx) return;
    const dpr = window.devicePixelRatio || 1;
    canvas.width = Math.ceil(layout.width * dpr);
    canvas.height = Math.ceil(layout.height * dpr);
    canvas.style.width = `${layout.width}px`;
    canvas.style.height = `${layout.height}px`;
    const palette = readPalette(canvas);
    const reduced = window.matchMedia("(prefers-reduced-motion: reduce)").matches;
    let frame = 0;
    const draw = () => {
      const since = flashStart.current === null || reduced ? FLASH_MS : performance.now() - flashStart.current;
      const level = flashLevel(since);
      ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
      ctx.clearRect(0, 0, layout.width, layout.height);
      const fontPx = Math.max(8, Math.min(11, layout.cell));
      ctx.font = `${fontPx}px system-ui, sans-serif`;
      ctx.textBaseline = "middle";
      ctx.fillStyle = rgbText(palette.label);
      const labelEvery = Math.max(1, Math.ceil(10 / (layout.cell + layout.gap)));
      map.layers.forEach((l, row) => {
        if (row % labelEvery !== 0) return;
        // Centred on its row, kept whole inside the drawing.
        const y = cellRect(layout, row, 0).y + layout.cell / 2;
        ctx.fillText(`L${l.layer}`, 0, Math.max(fontPx / 2, Math.min(layout.height - fontPx / 2, y)));
      });
      cells.forEach((c, i) => {
        const row = Math.floor(i / map.experts);
        const r = cellRect(layout, row, c.expert);
        let colour = mix(palette.tiers[c.tier], palette.empty, heatShare(c.heat));
        if (c.routed && level > 0) colour = mix(palette.flash, colour, level);
        ctx.fillStyle = rgbText(colour);
        ctx.fillRect(r.x, r.y, r.size, r.size);
        if (c.routed && layout.cell >= 5) {
          ctx.strokeStyle = rgbText(palette.ring);
          ctx.lineWidth = 1;
          ctx.strokeRect(r.x + 0.5, r.y + 0.5, r.size - 1, r.size - 1);
        }
      });
      if (cursor) {
        const r = cellRect(layout, cursor.row, cursor.col);
        ctx.strokeStyle = rgbText(palette.ring);
        ctx.lineWidth = 2;
        ctx.strokeRect(r.x - 1, r.y - 1, r.size + 2, r.size + 2);
      }
      if (level > 0) frame = requestAnimationFrame(draw);
    };
    draw();
    return () => cancelAnimationFrame(frame);
  }, [layout, cells, map, flash, cursor, themeTick, width]);

  const cellAt = (row: number, col: number): ExpertCell | undefined => cells[row * map.experts + col];
  const onMove = (e: MouseEvent<HTMLCanvasElement>) => {
    const rect = e.currentTarget.getBoundingClientRect();
    const x = e.clientX - rect.left;
    const y = e.clientY - rect.top;
    const hit = hitTest(layout, x, y);
    setHover(hit ? { ...hit, x, y } : null);
  };
  const onKey = (e: KeyboardEvent<HTMLCanvasElement>) => {
    const next = moveCursor(layout, cursor?.row ?? 0, cursor?.col ?? 0, e.key);
    if (next) {
      e.preventDefault();
      setCursor(next);
    } else if (e.key === "Escape") {
      setCursor(null);
    }
  };
  let shown = hover;
  if (shown === null && cursor !== null) {
    const r = cellRect(layout, cursor.row, cursor.col);
    shown = { ...cursor, x: r.x + r.size, y: r.y + r.size };
  }
  const tip = shown ? cellAt(shown.row, shown.col) : undefined;
  return (
    <div className="brain-canvas-box" ref={box}>
      <div className="brain-canvas-scroll">
        <canvas
          ref={ref}
          data-testid="brain-canvas"
          data-layout={JSON.stringify({ label: layout.label, cell: layout.cell, gap: layout.gap })}
          tabIndex={0}
          role="img"
          aria-label={`Expert map: ${map.layers.length} MoE layers by ${map.experts} experts. Arrow keys move through the cells; the table below lists them.`}
          onMouseMove={onMove}
          onMouseLeave={() => setHover(null)}
          onKeyDown={onKey}
          onFocus={() => setCursor((c) => c ?? { row: 0, col: 0 })}
          onBlur={() => setCursor(null)}
        />
        {tip && shown && (
          <div
            className="brain-tip"
            role="tooltip"
            data-testid="brain-tooltip"
            style={{ left: `${Math.min(shown.x + 12, Math.max(0, layout.width - 200))}px`, top: `${shown.y + 12}px` }}
          >
            {cellLabel(tip)}
          </div>
        )}
      </div>
    </div>
  );
}

/** The same map as a table (screen readers). Rows are made only while it is open; a big map
 * shows one layer at a time. */
function MapTable({ map, cells, byLayer }: { map: ExpertMap; cells: ExpertCell[]; byLayer: boolean }) {
  const [open, setOpen] = useState(false);
  const [layer, setLayer] = useState<number | null>(null);
  const selectId = useId();
  const chosen = layer ?? map.layers[0]?.layer ?? 0;
  const rows = byLayer ? cells.filter((c) => c.layer === chosen) : cells;
  return (
    <details className="brain-table" onToggle={(e) => setOpen(e.currentTarget.open)}>
      <summary>As a table</summary>
      {open && (
        <>
          {byLayer && (
            <p className="brain-layer">
              <label htmlFor={selectId}>Layer</label>{" "}
              <select id={selectId} value={chosen} onChange={(e) => setLayer(Number(e.target.value))}>
                {map.layers.map((l) => (
                  <option key={l.layer} value={l.layer}>
                    {l.layer}
                  </option>
                ))}
              </select>
            </p>
          )}
          <div className="table-wrap">
            <table className="turns" data-testid="brain-table">
              <thead>
                <tr>
                  <th scope="col">layer</th>
                  <th scope="col">expert</th>
                  <th scope="col">where</th>
                  <th scope="col">selections</th>
                  <th scope="col">last turn</th>
                </tr>
              </thead>
              <tbody>
                {rows.map((c) => (
                  <tr key={`${c.layer}-${c.expert}`}>
                    <td>{c.layer}</td>
                    <td>{c.expert}</td>
                    <td>{TIER_NAMES[c.tier]}</td>
                    <td>{c.count}</td>
                    <td>{c.routed ? "routed" : ""}</td>
                  </tr>
                ))}
              </tbody>
            </table>
          </div>
        </>
      )}
    </details>
  );
}
