# kernel_env's helpers in a Bash episode, sourced by kernel_env's bash_kernel
# (kernel_env/inkernel/bash_kernel.py) when its shell starts; the episode's setup cell is
# __kernel_env_setup <context file> <task prompt file>, which sets $context and $task_prompt.
#
# bash_kernel has no stdin requests of its own: a helper writes a request line (the kernel's
# tag, an operation and a file of NUL-separated arguments) to the terminal and reads the
# kernel's one-line status back; the kernel (a Python process reading the terminal) asks the
# host over the Jupyter stdin channel and writes the answers into the same file.
#
#   answer=$(llm_query "prompt")            # the answer on stdout
#   llm_query_batched "p1" "p2"             # the answers in the array llm_answers, and on stdout
#   FINAL 42    FINAL_VAR name              # end the episode with an answer

__kernel_env_call() {
  local request status
  request=$(mktemp "${TMPDIR:-/tmp}/.kernel_env.XXXXXX") || return 1
  printf '%s\0' "${@:2}" > "$request"
  printf '%s%s %s\n' "$__KERNEL_ENV_TAG" "$1" "$request" > /dev/tty
  IFS= read -r status < /dev/tty
  if [ "$status" != ok ]; then
    printf '%s: %s\n' "$1" "$(cat "$request")" >&2
    rm -f "$request"
    return 1
  fi
  mapfile -d '' -t __kernel_env_answers < "$request"
  rm -f "$request"
}

llm_query() {
  __kernel_env_call llm_query "$1" || return
  printf '%s\n' "${__kernel_env_answers[0]}"
}

llm_query_batched() {
  __kernel_env_call llm_query_batched "$@" || return
  llm_answers=("${__kernel_env_answers[@]}")
  printf '%s\n' "${llm_answers[@]}"
}

FINAL() {
  __kernel_env_call FINAL "$*"
}

FINAL_VAR() {
  FINAL "${!1}"
}

__kernel_env_probe() {
  __kernel_env_call probe ""
}

# An exported notebook's setup cell: its JSON parameters on stdin (context or context_path,
# task_prompt, replay: the recorded llm_query answers, which then answer offline).
__kernel_env_notebook() {
  local params
  params=$(mktemp "${TMPDIR:-/tmp}/.kernel_env.XXXXXX") || return 1
  cat > "$params"
  __kernel_env_call notebook "$params" || { rm -f "$params"; return 1; }
  rm -f "$params"
  context=${__kernel_env_answers[0]}
  task_prompt=${__kernel_env_answers[1]}
}

__kernel_env_setup() {
  IFS= read -r -d '' context < "$1" || true
  IFS= read -r -d '' task_prompt < "$2" || true
}
