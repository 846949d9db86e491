// @jupyterlab/services, the client library of JupyterLab and VS Code, against a server's
// Jupyter door: list the kernelspecs, start a kernel, run cells over its channels, list the
// running kernels, shut the kernel down. One JSON line per stage on stdout; the test reads them.
//
//   node jupyterlab_services.mjs BASE_URL TOKEN CODE...
import { KernelManager, KernelSpecManager, ServerConnection } from "@jupyterlab/services";
import WebSocket from "ws";

const [baseUrl, token, ...cells] = process.argv.slice(2);
const say = (stage, fields) => console.log(JSON.stringify({ stage, ...fields }));
const serverSettings = ServerConnection.makeSettings({
  baseUrl,
  wsUrl: baseUrl.replace(/^http/, "ws"),
  token,
  appendToken: true, // a browser's WebSocket cannot send a header: the token goes in the URL
  WebSocket,
});

async function run(kernel, code) {
  const future = kernel.requestExecute({ code });
  const outputs = [];
  future.onIOPub = (msg) => {
    const { msg_type: type } = msg.header;
    if (type === "stream") outputs.push(msg.content.text);
    if (type === "execute_result") outputs.push(msg.content.data["text/plain"]);
    if (type === "error") outputs.push(`${msg.content.ename}: ${msg.content.evalue}`);
  };
  const reply = await future.done;
  return { status: reply.content.status, outputs };
}

const specs = new KernelSpecManager({ serverSettings });
await specs.ready;
await specs.refreshSpecs();
const names = Object.keys(specs.specs?.kernelspecs ?? {});
say("specs", { names, default: specs.specs?.default });
const kernels = new KernelManager({ serverSettings });
await kernels.ready;
const kernel = await kernels.startNew({ name: specs.specs.default });
say("started", { id: kernel.id, name: kernel.name });
for (const code of cells) say("executed", { code, ...(await run(kernel, code)) });
await kernels.refreshRunning();
say("running", { ids: [...kernels.running()].map((model) => model.id) });
await kernel.shutdown();
await kernels.refreshRunning();
say("shutdown", { ids: [...kernels.running()].map((model) => model.id) });
kernels.dispose();
specs.dispose();
process.exit(0);
