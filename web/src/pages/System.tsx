import { useEffect, useState } from "react";
import { ServerError, errorText, expertBudget, fetchHealth, fetchInfo, type Connection, type EngineInfo, loadedRam, type Health, type ModelCard } from "../lib/api";
import { usePoll } from "../lib/poll";

const COUNTERS: [keyof Health, string][] = [
  ["active", "requests holding a KV slot now"],
  ["queued", "requests waiting for a slot now"],
  ["capacity", "KV slots"],
  ["max_queue", "limit of waiting requests"],
  ["admitted", "requests given a slot, since start"],
  ["completed", "generations that ended normally"],
  ["failed", "generations that ended in an error"],
  ["rejected", "429 queue_full answers"],
  ["timed_out", "429 queue_timeout answers"],
  ["cancelled", "clients gone while waiting or generating"],
];

/** Where the experts live and the RAM they may take (the expert cache's budget). */
function expertRam(cache: Record<string, unknown> | null): string {
  if (cache === null) return "all resident in RAM";
  const b = expertBudget(cache);
  if (b === null) return "RAM cache over the experts file (see Profiling)";
  return `RAM cache of ${b.slots} experts (${bytes(b.bytes)}), ${b.pinned} of them pinned; the rest read from disk (see Brain, Profiling)`;
}

function bytes(n: number): string {
  if (n >= 2 ** 30) return `${(n / 2 ** 30).toFixed(2)} GiB`;
  return n >= 2 ** 20 ? `${(n / 2 ** 20).toFixed(1)} MiB` : n >= 1024 ? `${(n / 1024).toFixed(1)} KiB` : `${n} B`;
}

export function System({ conn, models, modelsError }: { conn: Connection; models: ModelCard[]; modelsError: string | null }) {
  const [health, setHealth] = useState<Health | null>(null);
  const [error, setError] = useState<string | null>(null);
  const [at, setAt] = useState<Date | null>(null);
  const [info, setInfo] = useState<EngineInfo | null>(null);
  const [infoError, setInfoError] = useState<string | null>(null);

  useEffect(() => {
    const controller = new AbortController();
    fetchInfo(conn, controller.signal)
      .then((i) => {
        setInfo(i);
        setInfoError(null);
      })
      .catch((e: unknown) => {
        if (controller.signal.aborted) return;
        setInfo(null);
        setInfoError(errorText(e));
      });
    return () => controller.abort();
  }, [conn]);

  usePoll(
    5000,
    (signal) => fetchHealth(conn, signal),
    (h) => {
      setHealth(h);
      setError(null);
      setAt(new Date());
    },
    (e) => setError(e instanceof ServerError ? e.message : String(e)),
    [conn],
  );

  const restricted = health !== null && health.model === undefined;
  return (
    <section className="system" aria-label="System">
      <h1>System</h1>
      {error !== null && (
        <div className="error" role="alert">
          {error}
        </div>
      )}
      <div className="cards">
        <div className="card">
          <h2>Health</h2>
          {health === null ? (
            <p>loading…</p>
          ) : (
            <>
              <p>
                Status: <strong data-testid="health-status" className={health.status === "ok" ? "ok" : "bad"}>{health.status}</strong>
                {at && <span className="muted"> · {at.toLocaleTimeString()}, every 5 s</span>}
              </p>
              {health.error && <p className="error">{health.error}</p>}
              {restricted && <p className="muted">The server has an API key: enter it above to see the scheduler figures.</p>}
              {!restricted && (
                <table className="kv" data-testid="health-table">
                  <tbody>
                    {COUNTERS.map(([key, what]) => (
                      <tr key={key}>
                        <th scope="row" title={what}>{key}</th>
                        <td>{String(health[key] ?? "–")}</td>
                      </tr>
                    ))}
                    <tr>
                      <th scope="row">prefill</th>
                      <td>
                        {(health.prefill ?? []).length === 0
                          ? "none"
                          : (health.prefill ?? []).map((p, i) => (
                              <div key={i}>
                                slot {p.slot ?? "private"}: {p.prompt_tokens_done}/{p.prompt_tokens}
                              </div>
                            ))}
                      </td>
                    </tr>
                  </tbody>
                </table>
              )}
            </>
          )}
        </div>
        <div className="card">
          <h2>Model</h2>
          {modelsError !== null && <p className="error">{modelsError}</p>}
          {health?.ram_budget_bytes != null && (
            <p data-testid="ram-budget">
              RAM budget {bytes(health.ram_budget_bytes)}
              {health.models && <>, loaded models take {bytes(loadedRam(health.models))}</>}
            </p>
          )}
          {models.map((m) => {
            // /health's figures are the default model's (the one it names); the others get
            // their state and RAM from its catalog list.
            const own = health?.model === m.id ? health : null;
            const state = health?.models?.find((s) => s.id === m.id);
            return (
              <table className="kv" key={m.id} data-testid="model-table">
                <tbody>
                  <tr><th scope="row">id</th><td>{m.id}</td></tr>
                  {state && (
                    <tr>
                      <th scope="row">state</th>
                      <td data-testid="model-state">
                        <span className={state.state === "failed" ? "bad" : state.state === "loaded" ? "ok" : ""}>{state.state}</span>
                        {state.ram_bytes > 0 && `, ${bytes(state.ram_bytes)} of RAM`}
                        {state.error && <div className="error">{state.error}</div>}
                      </td>
                    </tr>
                  )}
                  <tr><th scope="row">context</th><td>{m.max_model_len ?? own?.context_length ?? "–"} tokens</td></tr>
                  {own?.kv_bytes_per_token !== undefined && (
                    <tr>
                      <th scope="row">KV per token</th>
                      <td>{bytes(own.kv_bytes_per_token)}</td>
                    </tr>
                  )}
                  {own?.kv_bytes_per_token !== undefined && own.context_length !== undefined && own.capacity !== undefined && (
                    <tr>
                      <th scope="row">KV at most</th>
                      <td>{bytes(own.kv_bytes_per_token * own.context_length * own.capacity)}</td>
                    </tr>
                  )}
                  <tr><th scope="row">model files</th><td>{new Date(m.created * 1000).toLocaleString()}</td></tr>
                </tbody>
              </table>
            );
          })}
        </div>
        <div className="card">
          <h2>Engine</h2>
          {infoError !== null && <p className="error">{infoError}</p>}
          {info && (
            <table className="kv" data-testid="engine-table">
              <tbody>
                <tr><th scope="row">architecture</th><td>{info.architecture ?? "–"}</td></tr>
                <tr>
                  <th scope="row">chat family</th>
                  <td>
                    {info.chat_family}
                    {info.chat_template === "builtin" && " (colibri's built-in template)"}
                    {info.chat_template === null && " (no chat template)"}
                  </td>
                </tr>
                <tr><th scope="row">weights</th><td>{info.quantization ?? "–"}</td></tr>
                <tr>
                  <th scope="row">shape</th>
                  <td>
                    {info.num_layers} layers, hidden {info.hidden_size}, {info.num_experts} experts ({info.experts_per_token} per token)
                  </td>
                </tr>
                <tr><th scope="row">kernel</th><td>{info.kernel}{info.kernel_avx_vnni ? " + AVX-VNNI" : ""} (prefetch {info.kernel_prefetch}{info.kernel_prefetch_decode !== undefined && info.kernel_prefetch_decode !== info.kernel_prefetch ? `, decode ${info.kernel_prefetch_decode}` : ""})</td></tr>
                <tr><th scope="row">threads</th><td>{info.threads}</td></tr>
                <tr><th scope="row">KV cache</th><td>{info.kv_dtype}, {info.kv_slots} slot(s)</td></tr>
                <tr>
                  <th scope="row">experts</th>
                  <td data-testid="expert-ram">{expertRam(info.expert_cache)}</td>
                </tr>
              </tbody>
            </table>
          )}
        </div>
      </div>
    </section>
  );
}
