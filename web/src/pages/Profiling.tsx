import { useState } from "react";
import { PHASES, errorText, fetchProfile, phaseShares, profileTotals, readOverlap, type Connection, type Profile, type TurnProfile } from "../lib/api";
import { usePoll } from "../lib/poll";

function bytes(n: number): string {
  if (n >= 1e9) return `${(n / 1e9).toFixed(2)} GB`;
  if (n >= 1e6) return `${(n / 1e6).toFixed(1)} MB`;
  if (n >= 1e3) return `${(n / 1e3).toFixed(1)} kB`;
  return `${n} B`;
}

function secs(s: number): string {
  if (s > 0 && s < 0.001) return `${(s * 1e6).toFixed(0)} µs`;
  return s < 1 ? `${(s * 1000).toFixed(1)} ms` : `${s.toFixed(2)} s`;
}

/** What the overlap figure means (the column's and the tile's tooltip). */
const OVERLAP_HELP =
  "Expert reading overlapped with compute = read busy time − I/O wait. Read busy time: the wall time during which at least one " +
  "expert read from disk was in flight (overlapping reads count once). I/O wait: the time the compute stood blocked waiting for " +
  "reads. The difference is reading hidden behind compute; shown as 0 when the wait exceeds it.";

/** One turn's overlap cell: overlapped seconds and their share of the read busy time. */
function Overlap({ turn }: { turn: TurnProfile }) {
  const o = readOverlap(turn);
  if (o === null) return <td className="muted" title="this server does not report read busy time">–</td>;
  if (o.busy === 0) return <td className="muted" data-testid="turn-overlap" data-overlap-s={0} title="no expert read in flight during this turn">no reads</td>;
  const title = `read busy ${secs(o.busy)} − I/O wait ${secs(o.wait)} = ${secs(o.overlapped)} overlapped with compute`;
  return (
    <td data-testid="turn-overlap" data-overlap-s={o.overlapped} title={title}>
      {secs(o.overlapped)} {o.share !== null && <span className="muted">({(o.share * 100).toFixed(0)}%)</span>}
    </td>
  );
}

function PhaseBar({ turn }: { turn: TurnProfile }) {
  const shares = phaseShares(turn);
  const title = shares.map((s) => `${s.label} ${secs(s.seconds)} (${(s.share * 100).toFixed(0)}%)`).join(", ");
  return (
    <div className="phasebar" role="img" aria-label={title} title={title}>
      {shares.map((s, i) => (
        <span key={s.phase} className={`ph ph${i}`} style={{ width: `${(s.share * 100).toFixed(2)}%` }} />
      ))}
    </div>
  );
}

/** Decode (and prefill) tok/s over the turns, oldest left: a hand-drawn SVG line chart. */
function Trend({ turns }: { turns: TurnProfile[] }) {
  const w = 600, h = 120, pad = 4;
  if (turns.length < 2) return <p className="muted">The trend shows from the second turn on.</p>;
  const max = Math.max(...turns.map((t) => t.decode_tok_s), 1e-9);
  const pts = turns
    .map((t, i) => {
      const x = pad + (i * (w - 2 * pad)) / (turns.length - 1);
      const y = h - pad - (t.decode_tok_s / max) * (h - 2 * pad);
      return `${x.toFixed(1)},${y.toFixed(1)}`;
    })
    .join(" ");
  return (
    <figure className="trend">
      <svg viewBox={`0 0 ${w} ${h}`} preserveAspectRatio="none" role="img" aria-label={`decode tok/s over the last ${turns.length} turns, up to ${max.toFixed(1)}`}>
        <polyline points={pts} fill="none" stroke="currentColor" strokeWidth="2" vectorEffect="non-scaling-stroke" />
      </svg>
      <figcaption className="muted">decode tok/s, last {turns.length} turns (oldest left), peak {max.toFixed(1)}</figcaption>
    </figure>
  );
}

export function Profiling({ conn }: { conn: Connection }) {
  const [profile, setProfile] = useState<Profile | null>(null);
  const [error, setError] = useState<string | null>(null);

  usePoll(
    2000,
    (signal) => fetchProfile(conn, signal),
    (p) => {
      setProfile(p);
      setError(null);
    },
    (e) => setError(errorText(e)),
    [conn],
  );

  const turns = profile?.turns ?? [];
  const totals = profileTotals(turns);
  const last = turns[turns.length - 1];
  return (
    <section className="system" aria-label="Profiling">
      <h1>Profiling</h1>
      {error !== null && (
        <div className="error" role="alert">
          {error}
        </div>
      )}
      {profile === null ? (
        error === null && <p>loading…</p>
      ) : turns.length === 0 ? (
        <p className="muted" data-testid="no-turns">No generation yet: ask something on the Chat page.</p>
      ) : (
        <>
          <div className="tiles">
            <div className="tile"><span className="muted">turns</span><strong data-testid="turn-count">{totals.turns}</strong></div>
            <div className="tile"><span className="muted">last decode</span><strong>{last ? `${last.decode_tok_s.toFixed(1)} tok/s` : "–"}</strong></div>
            <div className="tile"><span className="muted">last prefill</span><strong>{last ? `${last.prefill_tok_s.toFixed(1)} tok/s` : "–"}</strong></div>
            <div className="tile"><span className="muted">cache hit rate</span><strong data-testid="hit-rate">{totals.hitRate === null ? "all resident" : `${(totals.hitRate * 100).toFixed(1)}%`}</strong></div>
            <div className="tile"><span className="muted">expert bytes read</span><strong>{bytes(totals.bytesRead)}</strong></div>
            <div className="tile" title={OVERLAP_HELP}>
              <span className="muted">read overlapped with compute</span>
              <strong data-testid="overlap-total">
                {totals.overlapped === null || totals.readBusy === null
                  ? "–"
                  : totals.readBusy === 0
                    ? "no reads"
                    : `${secs(totals.overlapped)} of ${secs(totals.readBusy)} read`}
              </strong>
            </div>
          </div>
          <div className="card">
            <h2>Where the time went</h2>
            <p className="legend">
              {PHASES.map(([phase, label], i) => (
                <span key={phase}><span className={`swatch ph${i}`} aria-hidden="true" /> {label}</span>
              ))}
            </p>
            <p className="muted small" data-testid="overlap-legend">
              I/O wait is the time compute stood waiting for expert reads. Overlap = read busy time (wall time with at least one
              expert read from disk in flight, overlapping reads counted once) − I/O wait: the reading hidden behind compute, with
              its share of the read busy time. Other: the rest of each turn (sampling, norms, bookkeeping).
            </p>
            <div className="table-wrap">
              <table className="turns" data-testid="turns-table">
                <thead>
                  <tr>
                    <th scope="col">#</th>
                    <th scope="col">prompt</th>
                    <th scope="col">reply</th>
                    <th scope="col">time</th>
                    <th scope="col">decode</th>
                    <th scope="col" className="wide">phases</th>
                    <th scope="col">hits</th>
                    <th scope="col">read</th>
                    <th scope="col" title={OVERLAP_HELP}>overlap</th>
                  </tr>
                </thead>
                <tbody>
                  {turns
                    .map((t, i) => ({ t, n: i + 1 }))
                    .reverse()
                    .map(({ t, n }) => (
                      <tr key={n}>
                        <td>{n}</td>
                        <td>{t.prefill_tokens}</td>
                        <td>{t.decode_tokens}</td>
                        <td>{secs(t.prefill_s + t.decode_s)}</td>
                        <td>{t.decode_tok_s.toFixed(1)}</td>
                        <td className="wide"><PhaseBar turn={t} /></td>
                        <td>{`${(t.cache_hit_rate * 100).toFixed(0)}%`}</td>
                        <td>{bytes(t.bytes_read)}</td>
                        <Overlap turn={t} />
                      </tr>
                    ))}
                </tbody>
              </table>
            </div>
          </div>
          <div className="card">
            <h2>Speed trend</h2>
            <Trend turns={turns} />
          </div>
        </>
      )}
      {profile?.expert_cache && (
        <div className="card">
          <h2>Expert cache</h2>
          <table className="kv">
            <tbody>
              {Object.entries(profile.expert_cache).map(([k, v]) => (
                <tr key={k}>
                  <th scope="row">{k}</th>
                  <td>{typeof v === "object" && v !== null ? JSON.stringify(v) : String(v)}</td>
                </tr>
              ))}
            </tbody>
          </table>
        </div>
      )}
    </section>
  );
}
