// The two OpenAI API calls the page makes, each carrying the key: the served model's name, and a
// streamed chat completion.

import { eventData } from "./sse.js";

/** An answer in OpenAI's error shape, or a failure to reach the server. */
export class ApiError extends Error {
  constructor(message, status) {
    super(message);
    this.status = status;
  }
}

function headers(apiKey) {
  const sent = { "Content-Type": "application/json" };
  if (apiKey) sent.Authorization = `Bearer ${apiKey}`;
  return sent;
}

async function errorOf(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body?.error?.message) message = `${response.status}: ${body.error.message}`;
  } catch {
    // Not JSON: the status line says enough.
  }
  return new ApiError(message, response.status);
}

/** The id of the first model that /v1/models lists. */
export async function servedModel(apiKey) {
  const response = await fetch("/v1/models", { headers: headers(apiKey) });
  if (!response.ok) throw await errorOf(response);
  const models = await response.json();
  if (!models.data?.length) throw new ApiError("the server lists no model", response.status);
  return models.data[0].id;
}

/**
 * Streams one chat completion. `onEvent` gets { content } for each piece of text, then
 * { finishReason } and { usage } as they arrive. Aborting `signal` ends the request, and the
 * server aborts the generation when the connection closes.
 */
export async function streamChat({ apiKey, model, messages, params, signal, onEvent }) {
  const body = { model, messages, ...params, stream: true, stream_options: { include_usage: true } };
  const response = await fetch("/v1/chat/completions", {
    method: "POST",
    headers: headers(apiKey),
    body: JSON.stringify(body),
    signal,
  });
  if (!response.ok) throw await errorOf(response);
  for await (const data of eventData(response.body)) {
    if (data === "[DONE]") return;
    const chunk = JSON.parse(data);
    if (chunk.error) throw new ApiError(chunk.error.message ?? "the server reported an error", response.status);
    const choice = chunk.choices?.[0];
    if (choice?.delta?.content) onEvent({ content: choice.delta.content });
    if (choice?.finish_reason) onEvent({ finishReason: choice.finish_reason });
    if (chunk.usage) onEvent({ usage: chunk.usage });
  }
  throw new ApiError("the stream ended without [DONE]", response.status);
}
