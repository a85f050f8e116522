//! The local approximate prefix cache: a token-level radix tree remembering which worker was
//! sent which prompt, bounded in tokens, evicting least-recently-used leaves. Used by
//! `cache_aware` when no Indexer endpoint is configured.

use std::collections::HashMap;

/// One node: the tokens of its edge, its children by first token, and per worker the tick it
/// was last routed through this node.
#[derive(Debug, Default)]
struct Node {
    tokens: Vec<u64>,
    parent: usize,
    children: HashMap<u64, usize>,
    workers: HashMap<usize, u64>,
    last_used: u64,
}

/// A radix tree of routed prompts.
#[derive(Debug)]
pub struct RadixTree {
    nodes: Vec<Option<Node>>,
    free: Vec<usize>,
    tokens: usize,
    max_tokens: usize,
    tick: u64,
}

const ROOT: usize = 0;

impl RadixTree {
    /// A tree holding at most `max_tokens` tokens of edges.
    pub fn new(max_tokens: usize) -> RadixTree {
        RadixTree {
            nodes: vec![Some(Node::default())],
            free: Vec::new(),
            tokens: 0,
            max_tokens,
            tick: 0,
        }
    }

    pub fn tokens(&self) -> usize {
        self.tokens
    }

    fn node(&self, id: usize) -> &Node {
        self.nodes[id].as_ref().expect("live node")
    }

    fn node_mut(&mut self, id: usize) -> &mut Node {
        self.nodes[id].as_mut().expect("live node")
    }

    /// The eligible workers that were sent the longest prefix of `prompt`, and that prefix's
    /// length in tokens (0 and no workers when none shares a token).
    pub fn longest_match(
        &self,
        prompt: &[u64],
        eligible: impl Fn(usize) -> bool,
    ) -> (usize, Vec<usize>) {
        let mut best: (usize, Vec<usize>) = (0, Vec::new());
        let mut node = ROOT;
        let mut matched = 0;
        while matched < prompt.len() {
            let Some(&child) = self.node(node).children.get(&prompt[matched]) else {
                break;
            };
            let edge = &self.node(child).tokens;
            let common = edge
                .iter()
                .zip(&prompt[matched..])
                .take_while(|(a, b)| a == b)
                .count();
            matched += common;
            let mut here: Vec<usize> = self
                .node(child)
                .workers
                .keys()
                .copied()
                .filter(|&w| eligible(w))
                .collect();
            if !here.is_empty() {
                here.sort_unstable();
                best = (matched, here);
            }
            if common < edge.len() {
                break;
            }
            node = child;
        }
        best
    }

    /// Records that `prompt` was sent to `worker`, then evicts down to the bound.
    pub fn insert(&mut self, prompt: &[u64], worker: usize) {
        self.tick += 1;
        let tick = self.tick;
        let mut node = ROOT;
        let mut rest = prompt;
        while !rest.is_empty() {
            match self.node(node).children.get(&rest[0]).copied() {
                None => {
                    let child = self.alloc(Node {
                        tokens: rest.to_vec(),
                        parent: node,
                        children: HashMap::new(),
                        workers: HashMap::from([(worker, tick)]),
                        last_used: tick,
                    });
                    self.tokens += rest.len();
                    self.node_mut(node).children.insert(rest[0], child);
                    break;
                }
                Some(child) => {
                    let common = self
                        .node(child)
                        .tokens
                        .iter()
                        .zip(rest)
                        .take_while(|(a, b)| a == b)
                        .count();
                    let child = if common < self.node(child).tokens.len() {
                        self.split(child, common)
                    } else {
                        child
                    };
                    let n = self.node_mut(child);
                    n.workers.insert(worker, tick);
                    n.last_used = tick;
                    rest = &rest[common..];
                    node = child;
                }
            }
        }
        self.evict();
    }

    /// Splits `id` after `at` tokens; returns the new upper node.
    fn split(&mut self, id: usize, at: usize) -> usize {
        let (parent, head, workers, last_used) = {
            let n = self.node_mut(id);
            let tail = n.tokens.split_off(at);
            let head = std::mem::replace(&mut n.tokens, tail);
            (n.parent, head, n.workers.clone(), n.last_used)
        };
        let key = head[0];
        let tail_key = self.node(id).tokens[0];
        let upper = self.alloc(Node {
            tokens: head,
            parent,
            children: HashMap::from([(tail_key, id)]),
            workers,
            last_used,
        });
        self.node_mut(id).parent = upper;
        self.node_mut(parent).children.insert(key, upper);
        upper
    }

    fn alloc(&mut self, node: Node) -> usize {
        match self.free.pop() {
            Some(id) => {
                self.nodes[id] = Some(node);
                id
            }
            None => {
                self.nodes.push(Some(node));
                self.nodes.len() - 1
            }
        }
    }

    /// Removes least-recently-used leaves until the tree fits its bound.
    fn evict(&mut self) {
        while self.tokens > self.max_tokens {
            let victim = self
                .nodes
                .iter()
                .enumerate()
                .filter_map(|(id, n)| {
                    n.as_ref()
                        .filter(|n| id != ROOT && n.children.is_empty())
                        .map(|n| (n.last_used, id))
                })
                .min();
            let Some((_, id)) = victim else { return };
            let node = self.nodes[id].take().expect("live node");
            self.tokens -= node.tokens.len();
            self.node_mut(node.parent).children.remove(&node.tokens[0]);
            self.free.push(id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_workers_with_the_longest_shared_prefix() {
        let mut tree = RadixTree::new(1_000);
        tree.insert(&[1, 2, 3, 4, 5], 0);
        tree.insert(&[1, 2, 3, 9], 1);
        assert_eq!(tree.longest_match(&[1, 2, 3, 4, 7], |_| true), (4, vec![0]));
        assert_eq!(tree.longest_match(&[1, 2, 3, 9, 9], |_| true), (4, vec![1]));
        assert_eq!(tree.longest_match(&[1, 2], |_| true), (2, vec![0, 1]));
        assert_eq!(tree.longest_match(&[7], |_| true), (0, vec![]));
        assert_eq!(
            tree.longest_match(&[1, 2, 3, 4, 5], |w| w == 1),
            (3, vec![1])
        );
    }

    #[test]
    fn splitting_an_edge_keeps_both_branches() {
        let mut tree = RadixTree::new(1_000);
        tree.insert(&[1, 2, 3, 4], 0);
        tree.insert(&[1, 2], 1);
        tree.insert(&[1, 2, 5], 2);
        assert_eq!(tree.longest_match(&[1, 2, 3, 4], |_| true), (4, vec![0]));
        assert_eq!(tree.longest_match(&[1, 2, 5], |_| true), (3, vec![2]));
        assert_eq!(tree.tokens(), 5);
    }

    #[test]
    fn evicts_least_recently_used_leaves_to_its_bound() {
        let mut tree = RadixTree::new(8);
        tree.insert(&[1, 2, 3, 4], 0);
        tree.insert(&[5, 6, 7, 8], 1);
        tree.insert(&[1, 2, 3, 4], 0); // touch
        tree.insert(&[9, 9, 9, 9], 2);
        assert!(tree.tokens() <= 8);
        assert_eq!(tree.longest_match(&[5, 6, 7, 8], |_| true), (0, vec![]));
        assert_eq!(tree.longest_match(&[1, 2, 3, 4], |_| true), (4, vec![0]));
        assert_eq!(tree.longest_match(&[9, 9, 9, 9], |_| true), (4, vec![2]));
    }
}
