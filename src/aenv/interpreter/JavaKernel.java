// aenv's Java kernel: one JVM per context running JShell (the JDK's own Java REPL, jdk.jshell) in process,
// state kept between runs. Why not IJava (what E2B's template has): it is published only as GitHub releases.
// Started by the service (interpreter/java.py) as `java JavaKernel.java` (the JDK compiles a single source
// file as it launches). Pipes, as the JavaScript kernel's:
//   stdin  <- one request per line: base64(code) SP base64(env) SP base64(temp), env = k NUL v NUL k NUL v...
//             (env: system properties for good; temp: for this run only, as E2B's service sets Java's "envs")
//   events -> /proc/self/fd/$AENV_EVENTS_FD, one JSON object per line: {"type": "ready"} once, then per run
//             {"type": "stdout" | "stderr", "text"}, {"type": "result", "text"},
//             {"type": "error", "name", "value", "traceback"}, {"type": "done"}
import java.io.BufferedReader;
import java.io.FileOutputStream;
import java.io.InputStreamReader;
import java.io.OutputStream;
import java.io.PrintStream;
import java.io.PrintWriter;
import java.io.StringWriter;
import java.nio.charset.StandardCharsets;
import java.util.Base64;
import java.util.HashMap;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Locale;
import java.util.Map;
import java.util.stream.Collectors;

import jdk.jshell.Diag;
import jdk.jshell.EvalException;
import jdk.jshell.ExpressionSnippet;
import jdk.jshell.JShell;
import jdk.jshell.JShellException;
import jdk.jshell.Snippet;
import jdk.jshell.SnippetEvent;
import jdk.jshell.SourceCodeAnalysis;
import jdk.jshell.VarSnippet;

public class JavaKernel {
    private static PrintStream events;
    private static final byte[] RUN_END = "\0aenv-run-end\0\n".getBytes(StandardCharsets.UTF_8);
    private static final FileOutputStream RAW_OUT = new FileOutputStream(java.io.FileDescriptor.out);
    private static final FileOutputStream RAW_ERR = new FileOutputStream(java.io.FileDescriptor.err);

    private static synchronized void send(String json) {
        events.print(json + "\n");
        events.flush();
    }

    private static String quote(String s) {
        StringBuilder b = new StringBuilder("\"");
        for (char c : s.toCharArray()) {
            switch (c) {
                case '"': b.append("\\\""); break;
                case '\\': b.append("\\\\"); break;
                case '\n': b.append("\\n"); break;
                case '\r': b.append("\\r"); break;
                case '\t': b.append("\\t"); break;
                default:
                    if (c < 0x20) b.append(String.format("\\u%04x", (int) c));
                    else b.append(c);
            }
        }
        return b.append('"').toString();
    }

    private static void error(String name, String value, String traceback) {
        send("{\"type\":\"error\",\"name\":" + quote(name) + ",\"value\":" + quote(value)
             + ",\"traceback\":" + quote(traceback) + "}");
    }

    // Each write is one event. A subclass (the {} below): PrintStream.println of the class itself writes the
    // text and the line break at once; a subclass's prints them apart, as two events, as IJava's output is.
    private static PrintStream stream(String name) {
        OutputStream raw = new OutputStream() {
            @Override public void write(int b) { write(new byte[] {(byte) b}, 0, 1); }
            @Override public void write(byte[] buf, int off, int len) {
                send("{\"type\":\"" + name + "\",\"text\":" + quote(new String(buf, off, len, StandardCharsets.UTF_8)) + "}");
            }
        };
        return new PrintStream(raw, true, StandardCharsets.UTF_8) { };
    }

    private static Map<String, String> pairs(String encoded) {
        Map<String, String> out = new LinkedHashMap<>();
        String[] parts = new String(Base64.getDecoder().decode(encoded), StandardCharsets.UTF_8).split("\0", -1);
        for (int i = 0; i + 1 < parts.length; i += 2) out.put(parts[i], parts[i + 1]);
        return out;
    }

    // JShell shows a String as a Java literal ("a \"b\""); E2B shows the string itself.
    private static String shown(Snippet snippet, String value) {
        String type = snippet instanceof VarSnippet ? ((VarSnippet) snippet).typeName()
            : snippet instanceof ExpressionSnippet ? ((ExpressionSnippet) snippet).typeName() : "";
        if (!(type.equals("String") || type.equals("java.lang.String")) || value.length() < 2
                || !value.startsWith("\"") || !value.endsWith("\"")) {
            return value;
        }
        StringBuilder b = new StringBuilder();
        String body = value.substring(1, value.length() - 1);
        for (int i = 0; i < body.length(); i++) {
            char c = body.charAt(i);
            if (c != '\\' || i + 1 == body.length()) { b.append(c); continue; }
            char e = body.charAt(++i);
            switch (e) {
                case 'n': b.append('\n'); break;
                case 't': b.append('\t'); break;
                case 'r': b.append('\r'); break;
                case 'b': b.append('\b'); break;
                case 'f': b.append('\f'); break;
                case 'u':
                    if (i + 4 < body.length()) { b.append((char) Integer.parseInt(body.substring(i + 1, i + 5), 16)); i += 4; }
                    break;
                default: b.append(e);  // \" \' \\
            }
        }
        return b.toString();
    }

    private static void run(JShell shell, String code) {
        SourceCodeAnalysis analysis = shell.sourceCodeAnalysis();
        String remaining = code;
        String shown = null;
        while (!remaining.isBlank()) {
            SourceCodeAnalysis.CompletionInfo info = analysis.analyzeCompletion(remaining);
            String source = remaining;
            remaining = "";
            if (info.completeness().isComplete()) {
                source = info.source();
                remaining = info.remaining();
            }
            shown = null;
            for (SnippetEvent event : shell.eval(source)) {
                if (event.causeSnippet() != null) continue;  // a dependent snippet updated, not this run's own
                Snippet snippet = event.snippet();
                if (event.status() == Snippet.Status.REJECTED) {
                    List<Diag> diags = shell.diagnostics(snippet).collect(Collectors.toList());
                    String why = diags.stream().map(d -> d.getMessage(Locale.ROOT)).collect(Collectors.joining("\n"));
                    error("CompilationException", why.isEmpty() ? "the code does not compile" : why, source.strip());
                    return;
                }
                JShellException thrown = event.exception();
                if (thrown != null) {
                    String name = thrown instanceof EvalException
                        ? ((EvalException) thrown).getExceptionClassName() : thrown.getClass().getName();
                    StringWriter trace = new StringWriter();
                    thrown.printStackTrace(new PrintWriter(trace));
                    String message = thrown.getMessage();
                    error(name.substring(name.lastIndexOf('.') + 1), message == null ? "" : message, trace.toString());
                    return;
                }
                boolean expression = snippet.kind() == Snippet.Kind.EXPRESSION
                    || snippet.subKind() == Snippet.SubKind.TEMP_VAR_EXPRESSION_SUBKIND;
                if (expression && event.value() != null) shown = shown(snippet, event.value());
            }
        }
        if (shown != null) send("{\"type\":\"result\",\"text\":" + quote(shown) + "}");
    }

    public static void main(String[] args) throws Exception {
        events = new PrintStream(new FileOutputStream("/proc/self/fd/" + System.getenv("AENV_EVENTS_FD")), true,
                                 StandardCharsets.UTF_8);
        PrintStream out = stream("stdout");
        PrintStream err = stream("stderr");
        System.setOut(out);
        System.setErr(err);
        JShell shell = JShell.builder().executionEngine("local").out(out).err(err).build();
        for (SnippetEvent warm : shell.eval("int aenvWarm = 0;")) {  // the first evaluation loads the compiler:
            shell.drop(warm.snippet());                              // pay for it before "ready", keep nothing
        }
        send("{\"type\":\"ready\"}");
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8));
        String line;
        while ((line = in.readLine()) != null) {
            if (line.isBlank()) continue;
            String[] fields = line.split(" ", -1);
            pairs(fields[1]).forEach(System::setProperty);
            Map<String, String> temp = pairs(fields[2]);
            Map<String, String> saved = new HashMap<>();
            for (String key : temp.keySet()) saved.put(key, System.getProperty(key));
            temp.forEach(System::setProperty);
            try {
                run(shell, new String(Base64.getDecoder().decode(fields[0]), StandardCharsets.UTF_8));
            } catch (RuntimeException e) {
                error(e.getClass().getSimpleName(), String.valueOf(e.getMessage()), e.toString());
            } finally {
                for (Map.Entry<String, String> entry : saved.entrySet()) {
                    if (entry.getValue() == null) System.clearProperty(entry.getKey());
                    else System.setProperty(entry.getKey(), entry.getValue());
                }
                out.flush();
                err.flush();
                // what a child wrote to the inherited stdout/stderr reached them before this (pipe_kernels.RUN_END)
                try {
                    RAW_OUT.write(RUN_END);
                    RAW_OUT.flush();
                    RAW_ERR.write(RUN_END);
                    RAW_ERR.flush();
                } catch (java.io.IOException e) {
                    // the service is gone; nothing to mark for
                }
                send("{\"type\":\"done\"}");
            }
        }
    }
}
