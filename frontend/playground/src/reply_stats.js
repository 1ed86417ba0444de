// What a reply cost: its token counts (the server's usage, or a count of the streamed pieces when
// a stopped reply never got one), its time to first token and its generation speed.

export class ReplyStats {
  constructor() {
    this.sent = performance.now();
    this.firstToken = null;
    this.end = null;
    this.pieces = 0;
    this.usage = null;
    this.finishReason = null;
  }

  piece() {
    this.pieces += 1;
    if (this.firstToken === null) this.firstToken = performance.now();
  }

  finish() {
    this.end = performance.now();
  }

  /** Tokens per second from the first token to the end: the decoding speed, prompt processing left out. */
  tokensPerSecond(tokens) {
    const seconds = (this.end - this.firstToken) / 1000;
    return tokens > 1 && seconds > 0 ? (tokens - 1) / seconds : null;
  }

  /** One line for under the reply; `stopped` marks a reply the user cut short. */
  summary(stopped) {
    const parts = [];
    const tokens = this.usage ? this.usage.completion_tokens : this.pieces;
    // Without usage, each streamed piece is about one token: the server sends one per engine step.
    const approx = this.usage ? "" : "≈";
    if (this.usage) parts.push(`${this.usage.prompt_tokens} prompt tokens`);
    parts.push(`${approx}${tokens} tokens`);
    const speed = this.firstToken === null ? null : this.tokensPerSecond(tokens);
    if (speed !== null) parts.push(`${approx}${speed.toFixed(1)} tokens/s`);
    if (this.firstToken !== null) parts.push(`first token ${((this.firstToken - this.sent) / 1000).toFixed(2)} s`);
    if (stopped) parts.push("stopped");
    else if (this.finishReason === "length") parts.push("max_tokens reached");
    return parts.join(" · ");
  }
}
