import { useRef, useState, type CSSProperties } from "react";
import { errorText, expertCells, fetchExperts, type Connection, type ExpertCell, type ExpertMap } from "../lib/api";
import { usePoll } from "../lib/poll";

const PLACEMENT: Record<ExpertMap["placement"], string> = {
  resident: "every expert resident in RAM",
  cached: "a RAM cache over the experts file (per-expert placement is not reported yet)",
};

function cellLabel(c: ExpertCell): string {
  return `layer ${c.layer}, expert ${c.expert}: ${c.count} selections${c.routed ? ", routed in the last turn" : ""}`;
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

  const cells = map ? expertCells(map) : [];
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
            One cell per expert: a row per MoE layer, a column per expert. Brightness: how often the router chose it (log scale); a
            ring: routed to in the last turn ({map.turns} turns profiled). Placement: {PLACEMENT[map.placement]}.
          </p>
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
                    className={`cell${c.routed ? " hit" : ""}${c.routed && flash > 0 ? " flash" : ""}`}
                    style={{ "--heat": `${(8 + 92 * c.heat).toFixed(1)}%` } as CSSProperties}
                    title={cellLabel(c)}
                    data-layer={c.layer}
                    data-expert={c.expert}
                  />
                )),
            ])}
          </div>
          <details className="brain-table">
            <summary>As a table</summary>
            <div className="table-wrap">
              <table className="turns" data-testid="brain-table">
                <thead>
                  <tr>
                    <th scope="col">layer</th>
                    <th scope="col">expert</th>
                    <th scope="col">selections</th>
                    <th scope="col">last turn</th>
                  </tr>
                </thead>
                <tbody>
                  {cells.map((c) => (
                    <tr key={`${c.layer}-${c.expert}`}>
                      <td>{c.layer}</td>
                      <td>{c.expert}</td>
                      <td>{c.count}</td>
                      <td>{c.routed ? "routed" : ""}</td>
                    </tr>
                  ))}
                </tbody>
              </table>
            </div>
          </details>
        </div>
      )}
    </section>
  );
}
