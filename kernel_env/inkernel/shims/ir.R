# kernel_env's helpers in an R episode (IRkernel): sent as the episode's setup cell, then
# .kernel_env_setup(<context file>, <task prompt file>); an exported notebook's setup cell
# calls .kernel_env_notebook(<JSON>) instead, whose recorded llm_query answers replay offline.
# The helpers live on the search path ("kernel_env"), out of ls(); context and task_prompt are
# global variables.
# llm_query asks the host through IRkernel's readline(), a Jupyter stdin input_request whose
# prompt is the tag and a JSON request (kernel_env/inkernel/contract.py); FINAL publishes
# the answer under kernel_env's MIME type.
local({
  if ("kernel_env" %in% search()) detach("kernel_env", character.only = TRUE)
  tag <- "kernel_env/1:"
  probe <- "kernel_env/probe"
  mime <- "application/vnd.kernel-env.final+json"
  helpers <- new.env()
  replay <- NULL  # an exported notebook's recorded (prompt, response) pairs, when re-run

  take <- function(prompt) {
    for (i in seq_along(replay)) {
      if (identical(replay[[i]][[1]], prompt)) {
        response <- replay[[i]][[2]]
        replay[[i]] <<- NULL
        return(response)
      }
    }
    stop(paste("no recorded response for this prompt:", substr(prompt, 1, 80)), call. = FALSE)
  }

  ask <- function(op, args) {
    if (!is.null(replay)) {
      if (op == "llm_query") return(take(args$prompt))
      return(lapply(args$prompts, take))
    }
    request <- paste0(tag, jsonlite::toJSON(list(op = op, args = args), auto_unbox = TRUE))
    repeat {
      raw <- readline(request)
      if (!identical(raw, probe)) break
    }
    reply <- jsonlite::fromJSON(raw, simplifyVector = FALSE)
    if (!isTRUE(reply$ok)) {
      stop(if (is.null(reply$error)) paste(op, "failed") else reply$error, call. = FALSE)
    }
    reply$result
  }

  read_text <- function(path) {
    size <- file.size(path)
    if (is.na(size) || size == 0) return("")
    text <- readChar(path, size, useBytes = TRUE)
    Encoding(text) <- "UTF-8"
    text
  }

  helpers$llm_query <- function(prompt, model = NULL) {
    args <- list(prompt = paste(as.character(prompt), collapse = "\n"))
    if (!is.null(model)) args$model <- as.character(model)
    as.character(ask("llm_query", args))
  }

  helpers$llm_query_batched <- function(prompts, model = NULL) {
    args <- list(prompts = as.list(as.character(prompts)))
    if (!is.null(model)) args$model <- as.character(model)
    vapply(ask("llm_query_batched", args), as.character, "")
  }

  helpers$FINAL <- function(x) {
    answer <- paste(as.character(x), collapse = " ")
    bundle <- list(list(answer = answer), paste0("FINAL(", answer, ")"))
    names(bundle) <- c(mime, "text/plain")
    IRdisplay::publish_mimebundle(bundle)
    invisible(answer)
  }

  helpers$FINAL_VAR <- function(name) {
    name <- substitute(name)
    name <- if (is.symbol(name)) as.character(name) else as.character(eval(name, parent.frame()))
    helpers$FINAL(get(name, envir = globalenv()))
  }

  helpers$.kernel_env_setup <- function(context_path, task_path) {
    assign("context", read_text(context_path), envir = globalenv())
    assign("task_prompt", read_text(task_path), envir = globalenv())
    invisible(NULL)
  }

  helpers$.kernel_env_notebook <- function(json) {
    params <- jsonlite::fromJSON(json, simplifyVector = FALSE)
    text <- if (is.null(params$context_path)) params$context else read_text(params$context_path)
    assign("context", if (is.null(text)) "" else text, envir = globalenv())
    task <- if (is.null(params$task_prompt)) "" else params$task_prompt
    assign("task_prompt", task, envir = globalenv())
    replay <<- if (is.null(params$replay)) list() else params$replay
    invisible(NULL)
  }

  attach(helpers, name = "kernel_env", warn.conflicts = FALSE)
  invisible(NULL)
})
