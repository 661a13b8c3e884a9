import { useEffect, type DependencyList } from "react";

/** Calls `load` now and every `everyMs` while the page is visible, handing each result to
 * `onData` and each failure to `onError`, until `deps` change or the component goes away:
 * then the request in flight is aborted and whatever it brings is dropped. */
export function usePoll<T>(
  everyMs: number,
  load: (signal: AbortSignal) => Promise<T>,
  onData: (value: T) => void,
  onError: (e: unknown) => void,
  deps: DependencyList,
): void {
  useEffect(() => {
    let live = true;
    const controller = new AbortController();
    const poll = async () => {
      if (document.visibilityState === "hidden") return;
      try {
        const value = await load(controller.signal);
        if (live) onData(value);
      } catch (e) {
        if (live) onError(e);
      }
    };
    void poll();
    const timer = window.setInterval(() => void poll(), everyMs);
    return () => {
      live = false;
      controller.abort();
      window.clearInterval(timer);
    };
    // The callers' deps say when to start over; the callbacks are read fresh each poll.
  }, deps);
}
