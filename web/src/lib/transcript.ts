// A conversation as files: JSON (the chat request's own message shape, reasoning as
// `reasoning_content`, which the server accepts back) and Markdown (for reading).

export interface TranscriptTurn {
  role: "user" | "assistant";
  content: string;
  reasoning: string;
  finish: string | null;
}

export function toJson(model: string | null, turns: TranscriptTurn[]): string {
  const messages = turns.map((t) => {
    const m: Record<string, string> = { role: t.role, content: t.content };
    if (t.role === "assistant" && t.reasoning) m.reasoning_content = t.reasoning;
    return m;
  });
  return JSON.stringify({ model, messages }, null, 2) + "\n";
}

/** A fence longer than any run of backticks in `text`, so the text cannot close it. */
function fence(text: string): string {
  let longest = 0;
  for (const run of text.match(/`+/g) ?? []) longest = Math.max(longest, run.length);
  return "`".repeat(Math.max(3, longest + 1));
}

export function toMarkdown(model: string | null, turns: TranscriptTurn[]): string {
  const out: string[] = [`# Conversation with ${model ?? "the model"}`, ""];
  for (const t of turns) {
    out.push(t.role === "user" ? "## You" : `## ${model ?? "Assistant"}`, "");
    if (t.reasoning) {
      const f = fence(t.reasoning);
      out.push("<details><summary>Reasoning</summary>", "", `${f}text`, t.reasoning, f, "", "</details>", "");
    }
    out.push(t.content, "");
    if (t.finish === "length") out.push("*(truncated: the reply hit its token budget)*", "");
  }
  return out.join("\n");
}

/** Starts a download of `text` as a file (no network: a blob URL of the page itself). */
export function download(name: string, type: string, text: string): void {
  const url = URL.createObjectURL(new Blob([text], { type }));
  const a = document.createElement("a");
  a.href = url;
  a.download = name;
  document.body.appendChild(a);
  a.click();
  a.remove();
  window.setTimeout(() => URL.revokeObjectURL(url), 1000);
}
