//! One request's life in the simulated engine: wait for a running slot (at most `max_running`
//! requests run; the others queue), hash the prompt's whole pages as SGLang does, take its
//! place in the cache through the scheduler, queue for the one prefill lane and spend the time
//! model's prefill on the uncached tokens, emit deterministic filler tokens at the decode rate, and release the pages.
//!
//! Each request runs in its own task, tracked for shutdown, so a client that goes away does
//! not leave pages pinned: the task notices the closed channel and releases them.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use kv_prompt::BlockHasher;
use tokio::sync::{Semaphore, mpsc};
use tokio::time::Instant;
use tokio_util::task::TaskTracker;

use crate::scheduler::SchedulerHandle;
use crate::timing::{PrefillQueue, TimeModel};

/// Outputs buffered per request before the generator waits for its reader.
const OUTPUT_QUEUE: usize = 64;

/// The words of the filler text, cycled.
const FILLER: [&str; 16] = [
    " lorem",
    " ipsum",
    " dolor",
    " sit",
    " amet",
    ",",
    " consectetur",
    " adipiscing",
    " elit",
    ",",
    " sed",
    " do",
    " eiusmod",
    " tempor",
    " incididunt",
    ".",
];

/// Token ids of the filler, one per word, far from the prompt ids tests use.
const FILLER_FIRST_ID: u64 = 50_000;

#[derive(Debug, Clone, Copy)]
pub struct EngineConfig {
    pub hash: BlockHasher,
    pub timing: TimeModel,
    /// Requests running at once.
    pub max_running: usize,
}

/// A request as the engine sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GenerateRequest {
    pub input_ids: Vec<u64>,
    pub max_new_tokens: usize,
}

/// One item of a request's output stream.
#[derive(Debug, Clone, PartialEq)]
pub enum Output {
    /// Sent once, when the prefill is done: the cache's answer for the prompt.
    Prefilled {
        cached_tokens: usize,
    },
    Token {
        id: u64,
        text: &'static str,
    },
    /// The last item of a stream that completed.
    Finished(Usage),
}

/// What a finished request cost.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens found in the cache (device or host), whole pages only.
    pub cached_tokens: usize,
    /// From arrival to a running slot.
    pub queue_time: Duration,
    /// From arrival to the end.
    pub e2e_latency: Duration,
}

/// What the engine holds now, as SGLang's `/get_load` reports it per data-parallel rank.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// Requests in the engine: running or waiting for a slot.
    pub requests: usize,
    /// Requests waiting for a running slot.
    pub waiting: usize,
    /// Prompt tokens of the requests in the engine.
    pub tokens: usize,
    /// Uncached prompt tokens whose prefill has not ended: the prefill work queued.
    pub waiting_uncached_tokens: usize,
}

/// The counters behind [`LoadReport`].
#[derive(Debug, Default)]
struct LoadCounters {
    requests: AtomicUsize,
    waiting: AtomicUsize,
    tokens: AtomicUsize,
    waiting_uncached_tokens: AtomicUsize,
}

/// Adds `amount` to a counter until dropped, so that every way out of a request takes it off.
struct Counted<'a> {
    counter: &'a AtomicUsize,
    amount: usize,
}

impl<'a> Counted<'a> {
    fn add(counter: &'a AtomicUsize, amount: usize) -> Counted<'a> {
        counter.fetch_add(amount, Ordering::Relaxed);
        Counted { counter, amount }
    }
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        self.counter.fetch_sub(self.amount, Ordering::Relaxed);
    }
}

#[derive(Debug, Clone)]
pub struct Engine {
    config: EngineConfig,
    scheduler: SchedulerHandle,
    running: Arc<Semaphore>,
    prefills: PrefillQueue,
    tasks: TaskTracker,
    next_id: Arc<AtomicU64>,
    load: Arc<LoadCounters>,
}

impl Engine {
    pub fn new(config: EngineConfig, scheduler: SchedulerHandle, tasks: TaskTracker) -> Engine {
        Engine {
            running: Arc::new(Semaphore::new(config.max_running.max(1))),
            prefills: PrefillQueue::default(),
            config,
            scheduler,
            tasks,
            next_id: Arc::default(),
            load: Arc::default(),
        }
    }

    /// What the engine holds now.
    pub fn load(&self) -> LoadReport {
        let read = |counter: &AtomicUsize| counter.load(Ordering::Relaxed);
        LoadReport {
            requests: read(&self.load.requests),
            waiting: read(&self.load.waiting),
            tokens: read(&self.load.tokens),
            waiting_uncached_tokens: read(&self.load.waiting_uncached_tokens),
        }
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    pub fn scheduler(&self) -> &SchedulerHandle {
        &self.scheduler
    }

    /// Requests running now.
    pub fn running(&self) -> usize {
        self.config.max_running.max(1) - self.running.available_permits()
    }

    /// A fresh request id (SGLang's are hex strings).
    pub fn next_request_id(&self) -> String {
        format!("{:032x}", self.next_id.fetch_add(1, Ordering::Relaxed))
    }

    /// Starts `request`; its outputs arrive on the returned channel, which ends after
    /// [`Output::Finished`], or early when the worker stops. Dropping the receiver cancels the
    /// request.
    pub fn generate(&self, request: GenerateRequest) -> mpsc::Receiver<Output> {
        let (sender, receiver) = mpsc::channel(OUTPUT_QUEUE);
        let engine = self.clone();
        self.tasks
            .spawn(async move { engine.run(request, sender).await });
        receiver
    }

    async fn run(self, request: GenerateRequest, outputs: mpsc::Sender<Output>) {
        let arrived = Instant::now();
        let load = self.load.clone();
        let _request = Counted::add(&load.requests, 1);
        let _tokens = Counted::add(&load.tokens, request.input_ids.len());
        let waiting = Counted::add(&load.waiting, 1);
        let Ok(_slot) = self.running.clone().acquire_owned().await else {
            return;
        };
        drop(waiting);
        let started = Instant::now();
        let (hashes, tokens) = self.pages(&request.input_ids);
        let Ok(admitted) = self.scheduler.admit(hashes, tokens).await else {
            return;
        };
        let cached_tokens = self.cached_tokens(admitted.cached_pages, request.input_ids.len());
        let uncached = request.input_ids.len() - cached_tokens;
        let cost = self.config.timing.prefill(cached_tokens, uncached);
        let prefill_end = self.prefills.reserve(Instant::now(), cost);
        let queued = Counted::add(&load.waiting_uncached_tokens, uncached);
        let prefill_done = wait_until(prefill_end, &outputs).await;
        drop(queued);
        let mut completed = prefill_done
            && outputs
                .send(Output::Prefilled { cached_tokens })
                .await
                .is_ok();
        let prefilled = Instant::now();
        let mut completion_tokens = 0;
        while completed && completion_tokens < request.max_new_tokens {
            let index = completion_tokens;
            let token = Output::Token {
                id: FILLER_FIRST_ID + (index % FILLER.len()) as u64,
                text: FILLER[index % FILLER.len()],
            };
            completed = wait_until(prefilled + self.config.timing.token_offset(index), &outputs)
                .await
                && outputs.send(token).await.is_ok();
            completion_tokens += 1;
        }
        // Released before the answer ends: a client that saw its request finish finds the
        // pages unpinned.
        if self.scheduler.release(admitted.lease).await.is_err() || !completed {
            return;
        }
        let usage = Usage {
            prompt_tokens: request.input_ids.len(),
            completion_tokens,
            cached_tokens,
            queue_time: started - arrived,
            e2e_latency: arrived.elapsed(),
        };
        let _ = outputs.send(Output::Finished(usage)).await;
    }

    /// The hashes of the prompt's whole pages and the tokens they cover.
    fn pages(&self, input_ids: &[u64]) -> (Vec<i64>, Vec<u64>) {
        let block_size = self.config.hash.block_size();
        let bigram = self.config.hash.bigram();
        let units = if bigram {
            input_ids.len().saturating_sub(1)
        } else {
            input_ids.len()
        };
        let pages = units / block_size.max(1);
        let covered = (pages * block_size + usize::from(bigram && pages > 0)).min(input_ids.len());
        let tokens = input_ids[..covered].to_vec();
        (self.config.hash.block_hashes(&tokens, None), tokens)
    }

    /// SGLang computes at least the prompt's last token, so a hit covers at most the whole
    /// pages of all tokens but the last.
    fn cached_tokens(&self, cached_pages: usize, prompt_tokens: usize) -> usize {
        let block_size = self.config.hash.block_size().max(1);
        let limit = prompt_tokens.saturating_sub(1) / block_size;
        cached_pages.min(limit) * block_size
    }
}

/// Sleeps until `deadline`; false, at once, if the request's reader went away.
async fn wait_until(deadline: Instant, outputs: &mpsc::Sender<Output>) -> bool {
    tokio::select! {
        () = tokio::time::sleep_until(deadline) => true,
        () = outputs.closed() => false,
    }
}
