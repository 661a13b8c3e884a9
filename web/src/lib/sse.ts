// An incremental parser of Server-Sent Events (the WHATWG "text/event-stream" format), fed the
// bytes of a response body as they arrive, cut anywhere: inside a UTF-8 sequence, inside a line,
// between the CR and the LF of a line end.

export interface SseEvent {
  event: string;
  data: string;
  id: string | null;
}

export class SseParser {
  private readonly decoder = new TextDecoder("utf-8");
  private line = "";
  // A CR ended the last chunk: an LF starting the next one belongs to the same line end.
  private pendingCr = false;
  private started = false;
  private data: string[] = [];
  private eventType = "";
  private lastId: string | null = null;

  /** Parses the next bytes; returns the events they complete. */
  push(bytes: Uint8Array): SseEvent[] {
    return this.feed(this.decoder.decode(bytes, { stream: true }));
  }

  /** The stream ended: a last event without its blank line is dropped, as the spec says. */
  end(): SseEvent[] {
    const out = this.feed(this.decoder.decode());
    this.line = "";
    this.data = [];
    this.eventType = "";
    return out;
  }

  private feed(text: string): SseEvent[] {
    const out: SseEvent[] = [];
    if (!this.started && text.length > 0) {
      this.started = true;
      if (text.charCodeAt(0) === 0xfeff) text = text.slice(1);
    }
    let i = 0;
    if (this.pendingCr && text.length > 0) {
      this.pendingCr = false;
      if (text[0] === "\n") i = 1;
    }
    while (i < text.length) {
      const cr = text.indexOf("\r", i);
      const lf = text.indexOf("\n", i);
      let end: number;
      if (cr === -1) end = lf;
      else if (lf === -1) end = cr;
      else end = Math.min(cr, lf);
      if (end === -1) {
        this.line += text.slice(i);
        break;
      }
      this.line += text.slice(i, end);
      const ev = this.takeLine();
      if (ev !== null) out.push(ev);
      if (text[end] === "\r") {
        if (end + 1 === text.length) {
          this.pendingCr = true;
          i = end + 1;
        } else {
          i = text[end + 1] === "\n" ? end + 2 : end + 1;
        }
      } else {
        i = end + 1;
      }
    }
    return out;
  }

  private takeLine(): SseEvent | null {
    const line = this.line;
    this.line = "";
    if (line === "") {
      if (this.data.length === 0) {
        this.eventType = "";
        return null;
      }
      const ev: SseEvent = {
        event: this.eventType || "message",
        data: this.data.join("\n"),
        id: this.lastId,
      };
      this.data = [];
      this.eventType = "";
      return ev;
    }
    if (line.startsWith(":")) return null; // a comment (colibri's prefill progress)
    const colon = line.indexOf(":");
    const field = colon === -1 ? line : line.slice(0, colon);
    let value = colon === -1 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "data") this.data.push(value);
    else if (field === "event") this.eventType = value;
    else if (field === "id" && !value.includes("\0")) this.lastId = value;
    return null;
  }
}
