// Conversations kept in the browser's IndexedDB (this origin only; nothing goes to the server).

import type { TranscriptTurn } from "./transcript";

export interface Conversation {
  id: string;
  title: string;
  model: string | null;
  updatedAt: number;
  turns: TranscriptTurn[];
}

const DB = "colibri";
const STORE = "conversations";

function open(): Promise<IDBDatabase> {
  return new Promise((resolve, reject) => {
    const req = indexedDB.open(DB, 1);
    req.onupgradeneeded = () => {
      if (!req.result.objectStoreNames.contains(STORE)) req.result.createObjectStore(STORE, { keyPath: "id" });
    };
    req.onsuccess = () => resolve(req.result);
    req.onerror = () => reject(req.error ?? new Error("IndexedDB refused to open"));
  });
}

async function run<T>(mode: IDBTransactionMode, f: (s: IDBObjectStore) => IDBRequest<T>): Promise<T> {
  const db = await open();
  try {
    return await new Promise<T>((resolve, reject) => {
      const req = f(db.transaction(STORE, mode).objectStore(STORE));
      req.onsuccess = () => resolve(req.result);
      req.onerror = () => reject(req.error ?? new Error("IndexedDB request failed"));
    });
  } finally {
    db.close();
  }
}

export async function saveConversation(c: Conversation): Promise<void> {
  await run("readwrite", (s) => s.put(c));
}

export async function listConversations(): Promise<Conversation[]> {
  const all = await run<Conversation[]>("readonly", (s) => s.getAll() as IDBRequest<Conversation[]>);
  return all.sort((a, b) => b.updatedAt - a.updatedAt);
}

export async function deleteConversation(id: string): Promise<void> {
  await run("readwrite", (s) => s.delete(id));
}

/** The title of a conversation: its first question, shortened. */
export function titleOf(turns: TranscriptTurn[]): string {
  const first = turns.find((t) => t.role === "user")?.content.trim() ?? "";
  const line = first.split("\n")[0] ?? "";
  return line.length > 60 ? `${line.slice(0, 59)}…` : line || "(empty)";
}

/** Conversations whose title or any message contains every word of `query` (case-insensitive). */
export function searchConversations(all: Conversation[], query: string): Conversation[] {
  const words = query.toLowerCase().split(/\s+/).filter(Boolean);
  if (words.length === 0) return all;
  return all.filter((c) => {
    const text = [c.title, ...c.turns.map((t) => `${t.content}\n${t.reasoning}`)].join("\n").toLowerCase();
    return words.every((w) => text.includes(w));
  });
}
