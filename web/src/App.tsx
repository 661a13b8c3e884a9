import { useEffect, useMemo, useState } from "react";
import { ServerError, errorText, fetchHealth, fetchModels, type Connection, type ModelCard } from "./lib/api";
import { ROUTES, parseRoute, type Route } from "./lib/route";
import { applyTheme, loadTheme, nextTheme, type ThemeChoice } from "./lib/theme";
import { Chat, type ServerFacts } from "./pages/Chat";
import { Brain } from "./pages/Brain";
import { Profiling } from "./pages/Profiling";
import { Brio } from "./pages/Brio";
import { System } from "./pages/System";

// Served by colibri itself the API is on the page's own origin; the Vite dev server (port 5173)
// talks to a `colibri serve` on the default port, which allows that origin by CORS.
const BASE_URL = import.meta.env.DEV ? "http://127.0.0.1:8000" : "";

function useRoute(): Route {
  const [route, setRoute] = useState(() => parseRoute(window.location.hash));
  useEffect(() => {
    const on = () => setRoute(parseRoute(window.location.hash));
    window.addEventListener("hashchange", on);
    return () => window.removeEventListener("hashchange", on);
  }, []);
  return route;
}

const PAGE_NAMES: Record<Route, string> = { chat: "Chat", brain: "Brain", profiling: "Profiling", brio: "Brio", system: "System" };
const THEME_LABEL: Record<ThemeChoice, string> = { system: "Theme: system", light: "Theme: light", dark: "Theme: dark" };
const THEME_SHORT: Record<ThemeChoice, string> = { system: "Auto", light: "Light", dark: "Dark" };

export function App() {
  const route = useRoute();
  const [theme, setTheme] = useState<ThemeChoice>(loadTheme);
  // The API key lives in this state only: never written to storage or the URL. What is typed
  // is used once the typing pauses, so a half-typed key sends nothing.
  const [keyDraft, setKeyDraft] = useState("");
  const [apiKey, setApiKey] = useState("");
  useEffect(() => {
    const timer = window.setTimeout(() => setApiKey(keyDraft.trim()), 400);
    return () => window.clearTimeout(timer);
  }, [keyDraft]);
  const conn: Connection = useMemo(() => ({ baseUrl: BASE_URL, apiKey }), [apiKey]);
  const [models, setModels] = useState<ModelCard[]>([]);
  const [modelsError, setModelsError] = useState<string | null>(null);
  const [slotCount, setSlotCount] = useState(1);

  useEffect(() => applyTheme(theme), [theme]);

  useEffect(() => {
    const controller = new AbortController();
    const connect = async () => {
      // /health is public; it shows the scheduler only to a caller the server lets in, so it
      // tells whether a key is needed without a refused request.
      try {
        const h = await fetchHealth(conn, controller.signal);
        if (h.model === undefined && conn.apiKey === "") {
          setModels([]);
          setModelsError("This server requires an API key: enter it above (it stays in this page's memory only).");
          return;
        }
        setSlotCount(h.capacity ?? 1);
      } catch (e) {
        if (controller.signal.aborted) return;
        setModels([]);
        setModelsError(e instanceof ServerError ? e.message : String(e));
        return;
      }
      try {
        const m = await fetchModels(conn, controller.signal);
        setModels(m);
        setModelsError(null);
      } catch (e) {
        if (controller.signal.aborted) return;
        setModels([]);
        setModelsError(errorText(e));
      }
    };
    void connect();
    return () => controller.abort();
  }, [conn]);

  const first = models[0];
  const facts: ServerFacts = {
    model: first ? first.id : null,
    contextLength: first?.max_model_len ?? null,
    slotCount,
  };

  return (
    <div className="app">
      <button type="button" className="skip" onClick={() => document.getElementById("main")?.focus()}>
        Skip to content
      </button>
      <header className="top">
        <span className="brand">colibri</span>
        <nav aria-label="Pages">
          {ROUTES.map((r) => (
            <a key={r} href={`#/${r}`} aria-current={route === r ? "page" : undefined}>
              {PAGE_NAMES[r]}
            </a>
          ))}
        </nav>
        <span className="model" title="the served model">
          {facts.model ?? "no model"}
        </span>
        <label className="key">
          <span className="sr-only">API key</span>
          <input
            type="password"
            autoComplete="off"
            placeholder="API key (if any)"
            value={keyDraft}
            onChange={(e) => setKeyDraft(e.target.value)}
          />
        </label>
        <button
          type="button"
          className="theme"
          onClick={() => setTheme(nextTheme(theme))}
          aria-label={`${THEME_LABEL[theme]}; switch`}
          title={`${THEME_LABEL[theme]} (click to switch)`}
        >
          <span aria-hidden="true">◐ </span>
          {THEME_SHORT[theme]}
        </button>
      </header>
      {modelsError !== null && route === "chat" && (
        <div className="banner error" role="alert" data-testid="banner">
          {modelsError}
        </div>
      )}
      <main id="main" tabIndex={-1}>
        {route === "chat" && <Chat conn={conn} facts={facts} />}
        {route === "brain" && <Brain conn={conn} />}
        {route === "profiling" && <Profiling conn={conn} />}
        {route === "brio" && <Brio conn={conn} model={facts.model} />}
        {route === "system" && <System conn={conn} models={models} modelsError={modelsError} />}
      </main>
    </div>
  );
}
