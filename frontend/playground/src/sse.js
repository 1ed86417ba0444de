// Server-sent events from a fetch response body: each event's `data` lines joined, as the
// EventSource specification joins them. EventSource itself cannot POST or send a header.

/** Yields each event's data string, up to the end of the body. */
export async function* eventData(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffered = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffered += value.replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffered.indexOf("\n\n")) !== -1) {
      const event = buffered.slice(0, end);
      buffered = buffered.slice(end + 2);
      const data = event
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, ""));
      if (data.length > 0) yield data.join("\n");
    }
  }
}
