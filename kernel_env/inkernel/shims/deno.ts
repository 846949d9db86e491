// kernel_env's helpers in a JavaScript/TypeScript episode (Deno's Jupyter kernel): sent as the
// episode's setup cell, then __kernel_env_setup(<context file>, <task prompt file>); an exported
// notebook's setup cell calls __kernel_env_notebook({...}) instead, whose recorded llm_query
// answers replay offline. They are globals (globalThis), as are context and task_prompt.
// llm_query asks the host through prompt(), which Deno's kernel sends as a Jupyter stdin
// input_request whose prompt is the tag and a JSON request (kernel_env/inkernel/contract.py);
// FINAL displays the answer under kernel_env's MIME type.
{
  const TAG = "kernel_env/1:";
  const PROBE = "kernel_env/probe";
  const MIME = "application/vnd.kernel-env.final+json";
  // deno-lint-ignore no-explicit-any
  const g = globalThis as any;

  // An exported notebook's recorded [prompt, response] pairs, when it is re-run.
  let replay: [string, string][] | null = null;

  const take = (text: string): string => {
    const i = (replay ?? []).findIndex(([recorded]) => recorded === text);
    if (i < 0) throw new Error(`no recorded response for this prompt: ${text.slice(0, 80)}`);
    return replay!.splice(i, 1)[0][1];
  };

  const ask = (op: string, args: Record<string, unknown>): unknown => {
    if (replay !== null) {
      return op === "llm_query" ? take(args.prompt as string) : (args.prompts as string[]).map(take);
    }
    const request = TAG + JSON.stringify({ op, args });
    let raw = prompt(request);
    while (raw === PROBE) raw = prompt(request);
    if (raw === null) throw new Error(`${op}: the host did not answer (no stdin channel)`);
    const reply = JSON.parse(raw);
    if (!reply.ok) throw new Error(reply.error ?? `${op} failed`);
    return reply.result;
  };

  const withModel = (args: Record<string, unknown>, model?: string) =>
    model === undefined ? args : { ...args, model };

  g.llm_query = (text: string, model?: string): string =>
    String(ask("llm_query", withModel({ prompt: String(text) }, model)));

  g.llm_query_batched = (prompts: string[], model?: string): string[] =>
    (ask("llm_query_batched", withModel({ prompts: prompts.map(String) }, model)) as unknown[])
      .map(String);

  g.FINAL = (x: unknown): void => {
    const answer = typeof x === "string" ? x : String(x);
    Deno.jupyter.display({ [MIME]: { answer }, "text/plain": `FINAL(${answer})` }, { raw: true });
  };

  g.FINAL_VAR = (name: string): void => {
    if (!/^[A-Za-z_$][\w$]*$/.test(String(name))) throw new Error(`not a variable name: ${name}`);
    // An indirect eval reads the cell's top-level let and const bindings, which globalThis lacks.
    g.FINAL((0, eval)(String(name)));
  };

  g.__kernel_env_notebook = (params: Record<string, unknown>): void => {
    const path = params.context_path as string | undefined;
    g.context = path ? Deno.readTextFileSync(path) : String(params.context ?? "");
    g.task_prompt = String(params.task_prompt ?? "");
    replay = (params.replay as [string, string][] | undefined) ?? [];
  };

  g.__kernel_env_setup = (contextPath: string, taskPath: string): void => {
    g.context = Deno.readTextFileSync(contextPath);
    g.task_prompt = Deno.readTextFileSync(taskPath);
  };
}
