// Hash routes: the server serves one index.html and needs no fallback for client paths.

export const ROUTES = ["chat", "brain", "profiling", "brio", "system"] as const;
export type Route = (typeof ROUTES)[number];

export function parseRoute(hash: string): Route {
  const name = hash.replace(/^#\/?/, "").split(/[/?]/)[0] ?? "";
  return (ROUTES as readonly string[]).includes(name) ? (name as Route) : "chat";
}
